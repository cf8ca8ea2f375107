"""The arithmetic of model averaging: which tensors are averaged, and how.

Shared by every averager (:mod:`overlapkit.local_sgd.averagers`, DiLoCo's): torch's
selection rule — the parameters that have a gradient at this step — and torch's
flat-buffer arithmetic (one buffer, divided by the group size, then all-reduced), so
results are bitwise torch's.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.errors import ConfigurationError
from overlapkit.local_sgd.failures import wait_watching
from overlapkit.nodes.exit_safe import Hold

__all__ = ["PendingAverage", "ReplicaGroup", "average_in_place", "parameters_to_average"]


class ReplicaGroup(abc.ABC):
    """Replicas that average through something other than a ``torch.distributed``
    process group; an averager given one as its ``process_group`` averages over it.

    :class:`overlapkit.ft.ManagedReplicas` is one: the replica groups of a torchft
    ``Manager``'s current quorum, whose membership changes as replicas fail and
    rejoin. :func:`average_in_place` divides by :meth:`size` then sums with
    :meth:`all_reduce`, the arithmetic it uses on a process group.
    """

    @abc.abstractmethod
    def size(self) -> int:
        """How many replicas take part in the averaging now."""

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        """Reduce ``tensor`` in place over the replicas (``SUM`` or ``MAX``)."""

    def all_reduce_async(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> Any:
        """Start reducing ``tensor`` in place; return a handle whose ``wait()`` ends it.

        Streaming DiLoCo overlaps it with the inner steps. This default reduces at once
        (``wait()`` has nothing left to do); override it where the replicas' transport
        is asynchronous, as :class:`overlapkit.ft.ManagedReplicas` does.
        """
        self.all_reduce(tensor, op)
        return _Done()


class _Done:
    """The handle of a reduction that has already finished."""

    def wait(self) -> bool:
        return True


def parameters_to_average(
    params: Iterable[torch.Tensor] | Iterable[Mapping[str, Any]],
    group: dist.ProcessGroup | ReplicaGroup | None = None,
) -> list[torch.Tensor]:
    """The tensors of ``params`` (parameters, or an optimizer's ``param_groups``) that
    are averaged, once each, in order: those torch's ``get_params_to_average`` picks,
    the floating-point ones whose ``.grad`` is not ``None``.

    Parameters without a gradient at this step are left out as torch leaves them out:
    integer parameters (which cannot have one: averaging them is not even defined),
    frozen ones, and trainable ones no rank used. The flat buffer — whose layout
    decides the order in which a ring all-reduce sums each element — is then exactly
    torch's, and so are the results, bitwise, on any number of ranks. Under DDP every
    rank has gradients for the same parameters (DDP reduces them, and agrees on the
    unused ones), so the layout is the same on every rank.

    With ``group``, the ranks of the group agree first (one small all-reduce of a
    flag per tensor): a tensor that has a gradient on *some* ranks only is averaged
    on all of them. torch leaves it out where it has no gradient, so its ranks sum
    mismatched slices of their flat buffers (a silent accuracy loss, pytorch #74157);
    where every rank agrees — always under DDP — the choice is torch's. Call it with
    ``group`` on every rank of the group, with the same tensors in the same order.

    Where torch fails — no parameter has a gradient, e.g. averaging after
    ``zero_grad(set_to_none=True)`` — every floating-point parameter that can learn
    (``requires_grad=True``; plain tensors too) is averaged instead, a rule that reads
    only the parameters and so is the same on every rank.

    :raises ConfigurationError: an item is neither a tensor nor a parameter group.
    """
    _check_group(group)
    candidates: list[torch.Tensor] = []
    seen: set[int] = set()
    for item in params:
        if isinstance(item, torch.Tensor):
            tensors: Iterable[Any] = (item,)
        elif isinstance(item, Mapping) and "params" in item:
            tensors = item["params"]
        else:
            raise ConfigurationError(
                f"cannot average {type(item).__name__} objects; pass model.parameters() "
                "or an optimizer's param_groups."
            )
        for tensor in tensors:
            if id(tensor) not in seen and _floating(tensor):
                seen.add(id(tensor))
                candidates.append(tensor)
    has_grad = [t.grad is not None for t in candidates]
    if group is not None and candidates and _several(group):
        flags = torch.tensor(has_grad, dtype=torch.int32, device=candidates[0].device)
        if isinstance(group, ReplicaGroup):
            group.all_reduce(flags, dist.ReduceOp.MAX)
        else:
            wait_watching(dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group,
                                          async_op=True))
        has_grad = [bool(flag) for flag in flags.tolist()]
    with_grad = [t for t, grad in zip(candidates, has_grad, strict=True) if grad]
    if with_grad:
        return with_grad
    return [t for t in candidates if _learns(t)]


def _check_group(group: object) -> None:
    """A ConfigurationError unless ``group`` is something to average over (f2b92e2: a
    plugin averager's ``group_for_step`` returning ranks or an int failed with a bare
    ``AttributeError: 'list' object has no attribute 'size'``)."""
    if (group is None or isinstance(group, (dist.ProcessGroup, ReplicaGroup))
            or (type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER)):
        return
    raise ConfigurationError(
        f"the group to average over is a {type(group).__name__} ({group!r}), not a process "
        "group: an averager's group_for_step(step) must return a torch.distributed "
        "ProcessGroup (e.g. from dist.new_group(ranks), built once on every rank), a "
        "ReplicaGroup, or None for no averaging at that step.")


def _several(group: dist.ProcessGroup | ReplicaGroup) -> bool:
    if isinstance(group, ReplicaGroup):
        return group.size() > 1
    return not dist._rank_not_in_group(group) and dist.get_world_size(group) > 1


def _floating(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _learns(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad or not isinstance(tensor, torch.nn.Parameter)


def average_in_place(
    params: list[torch.Tensor], group: dist.ProcessGroup | ReplicaGroup
) -> None:
    """Replace each tensor in ``params`` by its mean over ``group``, in place.

    Tensors are flattened into one buffer per device (of the promoted dtype when the
    dtypes differ, as ``torch.cat`` makes it), divided by the group size, then
    all-reduced, and cast back on the copy: torch's ``average_parameters`` arithmetic,
    so results are bitwise equal to it. The values are copied back into the parameters
    rather than rebinding ``p.data`` to views of the flat buffer as torch does, so code
    that holds a parameter's storage (fused optimizers, bucket views) keeps seeing it.
    Ranks outside ``group`` and groups of one rank do nothing.
    """
    PendingAverage(params, group).wait()


class PendingAverage:
    """The mean of ``tensors`` over ``group``, started at construction; :meth:`wait`
    ends it and writes it back into the tensors.

    :func:`average_in_place` waits at once; Streaming DiLoCo (``async_op=True``) runs
    inner steps while the reduction is on the wire. One arithmetic for both, so a
    delay of 0 is bitwise the blocking averaging.

    :param group: a process group or a :class:`ReplicaGroup` (``None``: nothing to
        reduce, as a state loaded from a checkpoint that holds the mean already).
    """

    def __init__(self, tensors: list[torch.Tensor],
                 group: dist.ProcessGroup | ReplicaGroup | None, *,
                 async_op: bool = False) -> None:
        self.tensors = tensors
        self._pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        #: the last collective of a loop whose last step averages: gloo's threads must
        #: not need the GIL for its tensors (nodes.exit_safe); torchft's keep theirs
        self._holds: list[Hold] = []
        _check_group(group)
        if group is None or not tensors:
            return
        if isinstance(group, ReplicaGroup):
            size = group.size()
        elif dist._rank_not_in_group(group):
            return
        else:
            size = dist.get_world_size(group)
        if size == 1:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        for same_device in by_device.values():
            # torch.cat promotes mixed dtypes (bf16 and fp32 -> fp32) as torch's does;
            # made outside inference mode, which a Hold could not hold
            with torch.inference_mode(False):
                flat = torch.cat([t.detach().reshape(-1) for t in same_device])
            flat.div_(size)
            if not isinstance(group, ReplicaGroup):
                self._holds.append(Hold([flat], group))
            work: Any
            if isinstance(group, ReplicaGroup):
                if async_op:
                    work = group.all_reduce_async(flat, dist.ReduceOp.SUM)
                else:
                    group.all_reduce(flat, dist.ReduceOp.SUM)
                    work = None
            else:  # waited for watching for an averager's failure on another rank
                work = dist.all_reduce(flat, group=group, async_op=True)
            self._pending.append((work, flat, same_device))

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has nothing left to wait for."""
        return not self._pending

    def wait(self) -> list[torch.Tensor]:
        """Wait for the reduction, write the mean into the tensors and return them."""
        work = None
        for work, flat, same_device in self._pending:
            if isinstance(work, dist.Work):
                wait_watching(work)
            elif work is not None:
                work.wait()
            offset = 0
            with torch.no_grad():
                for t in same_device:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
        del work
        self._pending = []
        for hold in self._holds:  # the reductions are complete
            hold.release()
        self._holds = []
        return self.tensors

