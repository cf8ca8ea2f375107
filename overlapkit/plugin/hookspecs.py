"""The four hook specifications: overlapkit's extension points.

A plugin is a module (or any object) with functions marked ``@overlapkit.hookimpl``
whose names are the hook names below. Every hook is *collect-all*: each plugin returns
one record or a list of records (or ``None`` for nothing), and the registry gathers
them from every plugin, checks them for conflicts, and resolves lookups. Hooks are
called once, when the registry is first needed (at set-up: ``overlap_ddp``,
``create_averager``, ``overlapkit plugins``, ...), never per bucket or per step.

Plugins reach overlapkit through the ``overlapkit`` entry-point group::

    [project.entry-points.overlapkit]
    lion = "overlapkit_lion.plugin"

.. versionadded:: 0.1
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from overlapkit.plugin.records import (
        AveragerRecord,
        CommHookRecord,
        LoadPlannerRecord,
        OptimizerRecord,
    )

__all__ = [
    "hookimpl",
    "hookspec",
    "overlapkit_register_averagers",
    "overlapkit_register_comm_hooks",
    "overlapkit_register_load_planners",
    "overlapkit_register_optimizers",
]

PROJECT = "overlapkit"

hookspec = pluggy.HookspecMarker(PROJECT)
#: The marker for hook implementations: decorate a plugin's hook functions with it.
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def overlapkit_register_optimizers() -> OptimizerRecord | Sequence[OptimizerRecord] | None:
    """Register the overlapped implementations of optimizer classes.

    Called once when the registry is built, before the first ``overlap_ddp`` or
    ``optimizer_in_backward`` call. When an optimizer class is overlapped, its MRO is
    walked and the spec of the most specific class wins, so a plugin registers a
    faster implementation for its own optimizer without touching the generic one
    (registered for ``torch.optim.Optimizer``).

    :return: an :class:`~overlapkit.plugin.records.OptimizerRecord`, a list of them, or ``None``.
        Two plugins returning a spec for the same ``optim_cls`` is a
        :class:`~overlapkit.errors.PluginConflictError` naming both.
    """


@hookspec
def overlapkit_register_comm_hooks() -> CommHookRecord | Sequence[CommHookRecord] | None:
    """Register named DDP communication hooks.

    Called once when the registry is built. The names are what users pass as
    ``overlap_ddp(..., comm_hook=NAME)`` and to ``overlapkit.build_comm_hook(NAME)``;
    the overlapped optimizer step composes with every registered hook.

    :return: a :class:`~overlapkit.plugin.records.CommHookRecord`, a list of them, or ``None``.
        Two plugins providing the same name is a
        :class:`~overlapkit.errors.PluginConflictError` naming both.
    """


@hookspec
def overlapkit_register_averagers() -> AveragerRecord | Sequence[AveragerRecord] | None:
    """Register named model averagers for post-local SGD.

    Called once when the registry is built. The names are what users pass as
    ``post_local_sgd(..., averager=NAME)`` and to ``overlapkit.create_averager(NAME)``.

    :return: an :class:`~overlapkit.plugin.records.AveragerRecord`, a list of them, or ``None``.
        Two plugins providing the same name is a
        :class:`~overlapkit.errors.PluginConflictError` naming both.
    """


@hookspec
def overlapkit_register_load_planners() -> LoadPlannerRecord | Sequence[LoadPlannerRecord] | None:
    """Register named DCP load planners for sharded optimizer state.

    Called once when the registry is built. ``overlapkit.checkpoint.load`` and
    ``load_sharded_optimizer_state_dict`` pick a planner by name, or automatically
    from the state dict's layout through each spec's ``detect``.

    :return: a :class:`~overlapkit.plugin.records.LoadPlannerRecord`, a list of them, or
        ``None``. Two plugins providing the same name is a
        :class:`~overlapkit.errors.PluginConflictError` naming both.
    """
