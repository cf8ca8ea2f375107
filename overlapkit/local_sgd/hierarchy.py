"""The levels of hierarchical averaging, from the launch when the user gives none.

Users outgrow one machine with ``torchrun --nnodes N``; the levels that fit such a job
are the launch's own: average within each node (its ranks share fast links) every few
steps, across nodes (slow links) less often. :func:`plan_from_launch` builds that plan,
``{node_period: ranks per node, period: all ranks}``, from the node layout
(:func:`overlapkit.nodes.node_layout`: torchrun's agents, else host names), so
``post_local_sgd(..., averager="hierarchical")`` needs no ``period_group_size_dict``.

:func:`check_plan_follows_nodes` checks any plan, given or derived, against the launch:
every level's groups lie within a node or are whole nodes, so a plan written for one
shape of job is refused, before training, at a shape it does not fit.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist

from overlapkit.errors import ConfigurationError
from overlapkit.nodes import NodeLayout, node_layout

__all__ = ["check_plan_follows_nodes", "default_node_period", "plan_from_launch"]


def default_node_period(period: int) -> int:
    """How often a node averages when the user does not say: four times per
    across-node averaging (``period // 4``), at least every step."""
    return max(1, period // 4)


def _check_node_period(node_period: object, period: int) -> int:
    if (isinstance(node_period, bool) or not isinstance(node_period, int) or node_period < 1
            or node_period >= period):
        raise ConfigurationError(
            f"node_period must be an integer from 1 to period - 1 = {period - 1} (how often "
            f"the ranks of a node average, more often than all ranks do every {period} "
            f"steps), got {node_period!r}."
        )
    return node_period


def plan_from_launch(
    period: object,
    node_period: object = None,
    process_group: dist.ProcessGroup | None = None,
    layout: NodeLayout | None = None,
) -> dict[int, int]:
    """``{node_period: ranks per node, period: all ranks}``: the hierarchy of this launch.

    A collective unless ``layout`` is given (it gathers the node layout): call it on
    every rank of ``process_group``.

    :param period: steps between two averagings over every rank (across nodes).
    :param node_period: steps between two averagings within each node; default
        :func:`default_node_period`.
    :raises ConfigurationError: ``period`` below 2 (no room for a faster level), a
        ``node_period`` not below ``period``, or nodes of different sizes (on every rank
        alike).
    """
    if isinstance(period, bool) or not isinstance(period, int) or period < 2:
        raise ConfigurationError(
            f"the hierarchy taken from the launch needs period >= 2 (all ranks average "
            f"every `period` steps, each node more often), got {period!r}; pass e.g. "
            "period=16, or period_group_size_dict for a plan of your own."
        )
    node_period = _check_node_period(
        default_node_period(period) if node_period is None else node_period, period)
    if layout is None:
        layout = node_layout(process_group)
    per_node = layout.ranks_per_node("hierarchical averaging with levels from the launch")
    return {node_period: per_node, period: layout.world_size}


def check_plan_follows_nodes(plan: Mapping[int, int], layout: NodeLayout) -> None:
    """Raise unless every level of ``plan`` (period -> group size) has groups within a
    node or made of whole nodes, with this launch's ``layout``.

    :raises ConfigurationError: naming the level, the straddling group and the sizes
        that would fit.
    """
    for period, size in plan.items():
        layout.check_groups_follow_nodes(
            size, f"period_group_size_dict[{period}] = {size} does not fit the nodes")
