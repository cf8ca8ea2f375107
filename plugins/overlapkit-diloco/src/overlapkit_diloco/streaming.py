"""Streaming DiLoCo's overlapped synchronisation (Douillard et al. 2025, arXiv 2501.18512).

With ``fragment_sync_delay=d`` a fragment's pseudo-gradients are averaged by an
asynchronous allreduce started ``d`` inner steps before its outer step: the inner steps
run while the reduction is on the wire, and the outer step waits for it. This module
holds that reduction in flight (:class:`InFlightAverage`, overlapkit's
:class:`~overlapkit.plugin.PendingAverage` started asynchronously: the arithmetic of
:func:`overlapkit.plugin.average_in_place`, so ``d=0`` is bitwise the blocking
averaging) and checks the two options.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from overlapkit.plugin import ConfigurationError, PendingAverage, ReplicaGroup

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


class InFlightAverage(PendingAverage):
    """The mean over ``group`` of one fragment's pseudo-gradients, started at
    construction (asynchronously) and waited for by :meth:`wait`.

    :param fragment: which fragment the tensors are (checked when the result is used).
    :param tensors: the pseudo-gradients; replaced by their mean once :meth:`wait`
        returns.
    :param group: a process group or a :class:`~overlapkit.plugin.ReplicaGroup`
        (``None``: already averaged, as a state loaded from a checkpoint).
    """

    def __init__(self, fragment: int, tensors: list[torch.Tensor],
                 group: dist.ProcessGroup | ReplicaGroup | None) -> None:
        super().__init__(tensors, group, async_op=True)
        self.fragment = fragment
