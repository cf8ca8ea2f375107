"""What a plugin author imports: the hook marker, the records hooks return, and the base
classes a plugin extends.

A plugin is a module (or any object) with functions marked :data:`hookimpl` whose names
are hook specifications of :mod:`overlapkit.plugin.hookspecs`; each returns records.
Package it with an entry point in the ``overlapkit`` group::

    [project.entry-points.overlapkit]
    my_plugin = "my_package.plugin"

and overlapkit loads it on first use (``overlapkit plugins`` lists it). Everything a
plugin needs is importable from here; the other modules of this package are the
machinery (``manager``: loading and blocking; ``registry``: lookups and conflicts;
``wrappers``: pluggy's hook wrappers in the registry's collection).

.. versionadded:: 0.2
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlapkit.errors import (
    CheckpointError,
    ConfigurationError,
    OverlapkitError,
    PluginConflictError,
    PluginLoadError,
    PluginValidationError,
    UnknownNameError,
    UnsupportedOptimizerError,
)
from overlapkit.plugin.hookspecs import hookimpl, hookspec
from overlapkit.plugin.records import (
    AveragerRecord,
    AveragerSpec,
    CommHookRecord,
    CommHookSpec,
    LoadPlannerRecord,
    LoadPlannerSpec,
    OptimizerRecord,
    OptimizerSpec,
    normalize_name,
)

if TYPE_CHECKING:  # imported lazily at run time (see _LAZY)
    from overlapkit.local_sgd.averagers import (
        ModelAverager,
        PeriodicAverager,
        average_in_place,
        parameters_to_average,
    )
    from overlapkit.local_sgd.averaging import PendingAverage, ReplicaGroup
    from overlapkit.overlap.core.engine import OverlapEngine, OverlappedOptimizer, ParamGroup
    from overlapkit.overlap.core.generic import GenericOverlapEngine
    from overlapkit.plugin.manager import OverlapkitPluginManager

__all__ = [
    "CheckpointError",
    "GenericOverlapEngine",
    "PeriodicAverager",
    "average_in_place",
    "parameters_to_average",
    "OverlappedOptimizer",
    "OverlapkitPluginManager",
    "OptimizerSpec",
    "LoadPlannerSpec",
    "CommHookSpec",
    "AveragerSpec",
    "AveragerRecord",
    "CommHookRecord",
    "ConfigurationError",
    "LoadPlannerRecord",
    "ModelAverager",
    "OptimizerRecord",
    "OverlapkitError",
    "OverlapEngine",
    "ParamGroup",
    "PluginConflictError",
    "PluginLoadError",
    "PendingAverage",
    "PluginValidationError",
    "ReplicaGroup",
    "UnknownNameError",
    "UnsupportedOptimizerError",
    "hookimpl",
    "hookspec",
    "normalize_name",
]


#: the base classes and helpers that live beside the technique they serve (and import
#: torch): name -> module, imported on first use so loading the plugin manager stays light
_LAZY = {
    "OverlapEngine": "overlapkit.overlap.core.engine",
    "OverlappedOptimizer": "overlapkit.overlap.core.engine",
    "ParamGroup": "overlapkit.overlap.core.engine",
    "GenericOverlapEngine": "overlapkit.overlap.core.generic",
    "ModelAverager": "overlapkit.local_sgd.averagers",
    "PeriodicAverager": "overlapkit.local_sgd.averagers",
    "average_in_place": "overlapkit.local_sgd.averagers",
    "parameters_to_average": "overlapkit.local_sgd.averagers",
    "ReplicaGroup": "overlapkit.local_sgd.averaging",
    "PendingAverage": "overlapkit.local_sgd.averaging",
    "OverlapkitPluginManager": "overlapkit.plugin.manager",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'overlapkit.plugin' has no attribute {name!r}")
