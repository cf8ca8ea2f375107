"""Which ranks share a node: the launch's layout, for node-aware defaults and messages.

A **node** here is what torchrun calls one: the ranks one torchrun agent started, its
``GROUP_RANK`` (torchrun numbers them consecutively: the ``LOCAL_WORLD_SIZE`` ranks of
node 0 first, then node 1's, ...). Usually that is one machine, but not always: two
agents on one machine (a machine split between jobs, or several "nodes" on loopback
in a test) are two nodes, and that is the grouping that matters — a node's ranks are
the ones that start, fail and restart together, and the host name cannot tell two
agents on one machine apart. Without torchrun's ``GROUP_RANK`` (another launcher:
``srun``, ``mpirun``, a hand-rolled one), the ranks on one host name form a node.

:func:`this_node` reads the environment only; :func:`node_layout` gathers every rank's
answer (one small ``all_gather_object``), so every rank sees the same layout and
raises the same error for a layout that does not fit.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from overlapkit.errors import ConfigurationError

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["NodeLayout", "node_layout", "this_node"]


def this_node() -> tuple[str, str]:
    """``(key, description)`` of this process's node: ranks with the same key share a
    node. torchrun's ``GROUP_RANK`` when set, else the host name."""
    host = socket.gethostname()
    group_rank = os.environ.get("GROUP_RANK", "").strip()
    if group_rank:
        return f"agent:{group_rank}", f"torchrun node {group_rank} on host {host}"
    return f"host:{host}", f"host {host}"


def _ranges(ranks: Sequence[int]) -> str:
    """``0-3, 6`` for ``[0, 1, 2, 3, 6]``."""
    parts: list[str] = []
    start = previous = None
    for rank in sorted(ranks):
        if start is None:
            start = previous = rank
        elif rank == previous + 1:  # type: ignore[operator]
            previous = rank
        else:
            parts.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = previous = rank
    if start is not None:
        parts.append(f"{start}" if start == previous else f"{start}-{previous}")
    return ", ".join(parts)


@attrs.frozen(kw_only=True)
class NodeLayout:
    """The nodes of a process group: each node's ranks (ranks of the group), in order.

    :ivar nodes: the ranks of each node, nodes in the order of their first rank.
    :ivar names: how each node is described in messages (``torchrun node 1 on host
        host-a``, ``host host-a``).
    :ivar source: ``"torchrun"`` (agents' ``GROUP_RANK``) or ``"hostname"``.
    """

    nodes: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]
    source: str

    @property
    def world_size(self) -> int:
        """How many ranks the group has."""
        return sum(len(node) for node in self.nodes)

    def describe(self) -> str:
        """``2 nodes of 2 ranks (ranks 0-1: torchrun node 0 ...; ranks 2-3: ...)``."""
        sizes = sorted({len(node) for node in self.nodes})
        size = (f"{sizes[0]} rank{'s' if sizes[0] > 1 else ''}" if len(sizes) == 1
                else "unequal sizes")
        each = "; ".join(f"ranks {_ranges(node)}: {name}"
                         for node, name in zip(self.nodes, self.names, strict=True))
        return f"{len(self.nodes)} node{'s' if len(self.nodes) > 1 else ''} of {size} ({each})"

    def ranks_per_node(self, what: str) -> int:
        """The number of ranks every node has, each node's ranks consecutive.

        :param what: what needs it, for the message (``"the node-aware hierarchy"``).
        :raises ConfigurationError: the nodes differ in size, or a node's ranks are not
            consecutive (a launcher that numbers ranks round-robin over nodes).
        """
        sizes = {len(node) for node in self.nodes}
        consecutive = all(list(node) == list(range(node[0], node[0] + len(node)))
                          for node in self.nodes)
        if len(sizes) == 1 and consecutive:
            return sizes.pop()
        problem = ("the nodes run different numbers of ranks" if len(sizes) > 1
                   else "a node's ranks are not numbered consecutively")
        raise ConfigurationError(
            f"{what} needs nodes of equal size with consecutive ranks, but {problem}: "
            f"{self.describe()}. Launch the same number of ranks on every node "
            "(torchrun --nproc-per-node N on each), or pass the groups explicitly "
            "(period_group_size_dict=..., subgroup_size=N)."
        )

    def check_groups_follow_nodes(self, size: int, what: str) -> None:
        """Raise unless groups of ``size`` consecutive ranks each lie within one node
        or are made of whole nodes — a group that takes part of a node and part of
        another puts a slow inter-node link inside what should be a cheap level.

        :raises ConfigurationError: naming the first such group, and what to pass.
        """
        node_of = {rank: index for index, node in enumerate(self.nodes) for rank in node}
        for start in range(0, self.world_size, size):
            group = range(start, min(start + size, self.world_size))
            touched = sorted({node_of[rank] for rank in group})
            whole = sum(len(self.nodes[i]) for i in touched) == len(group)
            if len(touched) > 1 and not whole:
                sizes = sorted({len(node) for node in self.nodes})
                fitting = sorted({d for d in range(1, self.world_size + 1)
                                  if self.world_size % d == 0
                                  and all(s % d == 0 or d % s == 0 for s in sizes)})
                raise ConfigurationError(
                    f"{what}: a group of {size} ranks (ranks {_ranges(list(group))}) takes "
                    f"part of one node and part of another, with this launch: "
                    f"{self.describe()}. Use group sizes that divide the ranks of a node "
                    f"or are whole nodes (here one of {fitting}), or launch a number of "
                    "ranks per node that fits the plan."
                )


def node_layout(group: dist.ProcessGroup | None = None) -> NodeLayout:
    """The nodes of ``group`` (the default group when ``None``), as every rank reports
    its own (:func:`this_node`). A collective: call it on every rank of the group."""
    import torch.distributed as dist

    ranks = dist.get_world_size(group)
    mine = this_node()
    gathered: list[tuple[str, str] | None] = [None] * ranks
    dist.all_gather_object(gathered, mine, group=group)
    order: dict[str, list[int]] = {}
    names: dict[str, str] = {}
    for rank, answer in enumerate(gathered):
        assert answer is not None
        key, name = answer
        order.setdefault(key, []).append(rank)
        names[key] = name
    keys = list(order)
    return NodeLayout(
        nodes=tuple(tuple(order[key]) for key in keys),
        names=tuple(names[key] for key in keys),
        source="torchrun" if mine[0].startswith("agent:") else "hostname",
    )
