"""Streaming DiLoCo's overlapped synchronisation (Douillard et al. 2025, arXiv 2501.18512).

With ``fragment_sync_delay=d`` a fragment's pseudo-gradients are averaged by an
asynchronous allreduce started ``d`` inner steps before its outer step: the inner steps
run while the reduction is on the wire, and the outer step waits for it. This module
holds that reduction in flight (:class:`InFlightAverage`) and checks the two options.
Its arithmetic is :func:`overlapkit.plugin.average_in_place`'s (one flat buffer per
device, divided by the group size, then summed), so ``d=0`` is bitwise the blocking
averaging.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.plugin import ConfigurationError, ReplicaGroup

__all__ = ["InFlightAverage", "check_sync_delay", "check_update_alpha"]


def check_sync_delay(delay: object, sync_every: int) -> int:
    """``fragment_sync_delay``: an integer in ``[0, sync_every)``, torchft's rule (the
    average must have arrived before the fragment's next synchronisation starts)."""
    if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < sync_every:
        raise ConfigurationError(
            f"fragment_sync_delay must be an integer in [0, {sync_every}) (steps between "
            f"two outer steps: period // fragments), got {delay!r}; the fragment's average "
            "must arrive before its next sync starts. Pass a smaller delay, or a longer "
            "period."
        )
    return delay


def check_update_alpha(alpha: object) -> float:
    """``fragment_update_alpha``: a real number in ``[0, 1]``."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) \
            or not math.isfinite(alpha) or not 0 <= alpha <= 1:
        raise ConfigurationError(
            f"fragment_update_alpha must be a number in [0, 1] (the weight of the local "
            f"parameters mixed into the outer step's result), got {alpha!r}; 0 (the "
            "default) keeps the outer step's result alone."
        )
    return float(alpha)


class InFlightAverage:
    """The mean over ``group`` of one fragment's pseudo-gradients, started at
    construction and waited for by :meth:`wait`.

    :param fragment: which fragment the tensors are (checked when the result is used).
    :param tensors: the pseudo-gradients; replaced by their mean once :meth:`wait`
        returns.
    :param group: a process group or a :class:`~overlapkit.plugin.ReplicaGroup`
        (``None``: already averaged, as a state loaded from a checkpoint).
    """

    def __init__(self, fragment: int, tensors: list[torch.Tensor],
                 group: dist.ProcessGroup | ReplicaGroup | None) -> None:
        self.fragment = fragment
        self.tensors = tensors
        self._works: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        if group is None:
            return
        if isinstance(group, ReplicaGroup):
            size = group.size()
        elif dist._rank_not_in_group(group):
            return
        else:
            size = dist.get_world_size(group)
        if size == 1 or not tensors:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        for same_device in by_device.values():
            flat = torch.cat([t.reshape(-1) for t in same_device])
            flat.div_(size)
            if isinstance(group, ReplicaGroup):
                work = group.all_reduce_async(flat, dist.ReduceOp.SUM)
            else:
                work = dist.all_reduce(flat, group=group, async_op=True)
            self._works.append((work, flat, same_device))

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has nothing left to wait for."""
        return not self._works

    def wait(self) -> list[torch.Tensor]:
        """Wait for the reduction and return the averaged tensors."""
        for work, flat, same_device in self._works:
            work.wait()
            offset = 0
            for t in same_device:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        self._works = []
        return self.tensors
