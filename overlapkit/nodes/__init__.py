"""Past one machine: which ranks share a node, and which ranks a failure lost.

- :mod:`~overlapkit.nodes.layout`: a node is a torchrun agent (``GROUP_RANK``), else a
  host name; :func:`node_layout` gathers every rank's, for node-aware defaults
  (post-local SGD's hierarchy from the launch) and the checks of a launch against them;
- :mod:`~overlapkit.nodes.roll_call`: the ranks still there, asked through the process
  group's store (answers, heartbeats, notes left at exit);
- :mod:`~overlapkit.nodes.lost_ranks`: a collective of overlapkit's that fails because
  ranks are gone raises :class:`~overlapkit.errors.RanksLostError` naming them;
- :mod:`~overlapkit.nodes.failed_collective`: a failed collective of an overlapped
  step (a bucket's reduction, the parameter exchange) as one overlapkit error, naming
  the ranks that are gone or that stopped taking part;
- :mod:`~overlapkit.nodes.exit_safe`: collectives that may be a program's last hold
  their tensors until gloo's threads let go, so those threads never need the GIL for
  them (one that does while the interpreter exits aborts the process in torch 2.13).

``docs/nodes.rst`` ("Running on several machines") is the user's side of it. Imports
no torch (the collectives import it when they run).
"""

from __future__ import annotations

from overlapkit.nodes.layout import NodeLayout, node_layout, this_node

__all__ = ["NodeLayout", "node_layout", "this_node"]
