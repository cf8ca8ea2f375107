"""The replica groups of a torchft ``Manager``'s quorum, as an overlapkit averaging group.

torchft (PyTorch's per-step fault tolerance) decides at every quorum which replica
groups take part; its ``Manager.allreduce`` runs over them through a process group it
reconfigures when one fails or rejoins. :class:`ManagedReplicas` lets overlapkit's
averagers average over that quorum with their own arithmetic (one flat buffer divided
by the number of participants, then summed), so a run under torchft with no failure
is bitwise the run over a ``torch.distributed`` process group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from overlapkit.local_sgd.averaging import ReplicaGroup

__all__ = ["ManagedReplicas"]


class ManagedReplicas(ReplicaGroup):
    """The participants of ``manager``'s current quorum.

    Only valid between ``manager.start_quorum()`` and ``manager.should_commit()``:
    :class:`~overlapkit.ft.FaultTolerantLocalSGD` calls both around each averaging.
    A collective that fails (a replica died in it) does not raise: torchft records the
    error, the tensor is left as it was, and ``should_commit()`` answers ``False``.

    :param manager: a ``torchft.Manager``.
    """

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def size(self) -> int:
        """How many replica groups take part in the current quorum."""
        return int(self.manager.num_participants())

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        """Reduce ``tensor`` in place over the quorum through ``manager.allreduce``."""
        self.manager.allreduce(tensor, reduce_op=op).wait()

    def all_reduce_async(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> Any:
        """Start ``manager.allreduce`` over the quorum and return its work handle: the
        reduction runs on torchft's process group while the inner steps go on."""
        return self.manager.allreduce(tensor, reduce_op=op)

    def __repr__(self) -> str:
        return f"ManagedReplicas(quorum of {type(self.manager).__name__})"
