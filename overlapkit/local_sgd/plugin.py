"""Built-in plugin ``overlapkit.local_sgd``: post-local SGD's averagers and comm hook.

Averagers ``periodic`` (:class:`~overlapkit.local_sgd.averagers.PeriodicAverager`) and
``hierarchical`` (:class:`~overlapkit.local_sgd.averagers.HierarchicalAverager`); comm hook
``post_local_sgd`` (:func:`~overlapkit.local_sgd.comm_hook.post_local_sgd_hook`).

Every averager build takes ``period``, ``warmup_steps`` and ``process_group``, the
options :func:`overlapkit.post_local_sgd` passes; a plugin averager should too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from overlapkit.errors import ConfigurationError
from overlapkit.local_sgd.averagers import (
    HierarchicalAverager,
    PeriodicAverager,
    check_averager,
    validate_period_group_sizes,
)
from overlapkit.local_sgd.comm_hook import build_post_local_sgd_hook
from overlapkit.local_sgd.hierarchy import plan_from_launch
from overlapkit.plugin.hookspecs import hookimpl
from overlapkit.plugin.manager import get_plugin_manager
from overlapkit.plugin.records import AveragerRecord, CommHookRecord

__all__ = ["create_averager", "overlapkit_register_averagers", "overlapkit_register_comm_hooks"]


def build_periodic(
    *, period: int, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None
) -> PeriodicAverager:
    """A :class:`~overlapkit.local_sgd.averagers.PeriodicAverager`."""
    return PeriodicAverager(period, warmup_steps, process_group)


def build_hierarchical(
    *,
    period_group_size_dict: Mapping[int, int] | None = None,
    warmup_steps: int = 0,
    process_group: dist.ProcessGroup | None = None,
    period: int | None = None,
    node_period: int | None = None,
) -> HierarchicalAverager:
    """A :class:`~overlapkit.local_sgd.averagers.HierarchicalAverager`.

    With ``period_group_size_dict``, that plan; ``period``, when given, must be its
    largest period (how often all ranks average). Without it, the levels come from the
    launch (:func:`~overlapkit.local_sgd.hierarchy.plan_from_launch`): each node every
    ``node_period`` steps (default ``period // 4``), all ranks every ``period`` steps.
    """
    if period_group_size_dict is None:
        if period is None:
            raise ConfigurationError(
                "the hierarchical averager needs period_group_size_dict, or period (how "
                "often all ranks average) to take the levels from the launch: each node "
                "averages every node_period steps (default period // 4), all ranks every "
                "period steps."
            )
        plan = plan_from_launch(period, node_period, process_group)
        return HierarchicalAverager(plan, warmup_steps, process_group)
    if node_period is not None:
        raise ConfigurationError(
            "node_period sets the node level of the plan taken from the launch, but "
            "period_group_size_dict was given too; pass one of them (the plan's own "
            "periods are its levels)."
        )
    largest = max(validate_period_group_sizes(period_group_size_dict, None))
    if period is not None and period != largest:
        raise ConfigurationError(
            f"period={period} but the largest period in period_group_size_dict is "
            f"{largest}; for the hierarchical averager, period is how often all ranks "
            f"average: pass period={largest} or change the plan."
        )
    return HierarchicalAverager(period_group_size_dict, warmup_steps, process_group)


def create_averager(name: str, **options: Any) -> Any:
    """Build the model averager registered as ``name`` (``"periodic"``,
    ``"hierarchical"``, or a plugin's).

    :param options: the averager's own options, e.g. ``period=4, warmup_steps=100``
        for ``periodic``; ``period_group_size_dict={4: 2, 16: 8}`` for
        ``hierarchical``; every averager also takes ``process_group``.
    :raises UnknownNameError: no plugin provides ``name``; the message lists the valid
        names.
    :raises ConfigurationError: an unknown or invalid option.
    """
    spec = get_plugin_manager().registry.averager(name)
    averager = spec.create(**options)
    check_averager(averager, name)
    return averager


@hookimpl
def overlapkit_register_averagers() -> list[AveragerRecord]:
    return [
        AveragerRecord(
            name="periodic",
            build=build_periodic,
            description="average all parameters over the group every `period` steps",
        ),
        AveragerRecord(
            name="hierarchical",
            build=build_hierarchical,
            description="average over groups of several sizes, each at its own period",
        ),
    ]


@hookimpl
def overlapkit_register_comm_hooks() -> list[CommHookRecord]:
    return [
        CommHookRecord(
            name="post_local_sgd",
            build=build_post_local_sgd_hook,
            description="allreduce globally during warm-up, within the subgroup after",
        ),
    ]
