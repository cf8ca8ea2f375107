"""What a plugin author imports: the hook marker, the records hooks return, and the base
classes a plugin extends.

A plugin is a module (or any object) with functions marked :data:`hookimpl` whose names
are hook specifications of :mod:`overlapkit.plugin.hookspecs`; each returns records.
Package it with an entry point in the ``overlapkit`` group::

    [project.entry-points.overlapkit]
    my_plugin = "my_package.plugin"

and overlapkit loads it on first use (``overlapkit plugins`` lists it). Everything a
plugin needs is importable from here; the other modules of this package are the
machinery (``manager``: loading and blocking; ``registry``: lookups and conflicts).

.. versionadded:: 0.2
"""

from __future__ import annotations

from overlapkit.errors import (
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

__all__ = [
    "OverlappedOptimizer",
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
    "PluginValidationError",
    "UnknownNameError",
    "UnsupportedOptimizerError",
    "hookimpl",
    "hookspec",
    "normalize_name",
]


def __getattr__(name: str) -> object:
    # The base classes live beside the technique they serve and import torch; they are
    # imported on first use, so that loading the plugin manager stays light.
    if name in ("OverlapEngine", "OverlappedOptimizer", "ParamGroup"):
        from overlapkit.overlap import engine

        return getattr(engine, name)
    if name == "ModelAverager":
        from overlapkit.local_sgd.averagers import ModelAverager

        return ModelAverager
    raise AttributeError(f"module 'overlapkit.plugin' has no attribute {name!r}")
