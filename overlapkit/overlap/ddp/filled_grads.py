"""Filling the local gradients with the reduced ones while a rank waits for later
reductions, so that DDP's finalize has nothing left to copy after the last one.

With ``gradient_as_bucket_view=False`` (DDP's default) each parameter's ``.grad`` is a
tensor of its own, and DDP's finalize copies the reduced bucket into it
(``Reducer::copy_bucket_to_grad``, torch 2.13). Plain DDP's finalize waits for each
bucket's future in turn and copies that bucket as soon as it completes: over a slow
link the copies hide in the wait for the next bucket. The bucket stepper drains every
bucket *before* DDP's finalize (it must step them first), so there all the copies came
after the last reduction: 2.3 ms of the 4.2 ms a step of 8 x ``Linear(1024)`` took after
its last transfer ended, more than the step of the last bucket itself (measured with
``torch.profiler``, 2 gloo ranks over the 1 Gb/s simulated link of
``overlapkit bench --only network_bound``).

So a run of buckets stepped while later reductions are still in flight (time the rank
would spend waiting) also copies its reduced gradients into the parameters' own
``.grad`` (:meth:`FilledGradients.fill`); just before DDP's finalize the filled
parameters are lent the bucket's view as ``.grad`` (:meth:`~FilledGradients.lend`), so
that DDP's copy is of the bucket onto itself, which ``Tensor.copy_`` skips (same memory,
offset and strides: measured 1.4 us against 63 us for 4 MiB); right after the finalize
(:meth:`~FilledGradients.give_back`) each ``.grad`` is its own tensor again, holding
what DDP would have copied: the same tensor and the same bits as in the plain loop.
"""

from __future__ import annotations

import torch

__all__ = ["FilledGradients"]


class FilledGradients:
    """The parameters whose own ``.grad`` already holds its reduced gradient, during
    one backward (see the module docstring)."""

    def __init__(self) -> None:
        #: (parameter, its own gradient, filled from this view of the bucket)
        self._filled: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        #: the same, while the view is lent as ``.grad`` through DDP's finalize
        self._lent: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def fill(self, local_grads: list[tuple[torch.Tensor, torch.Tensor | None]],
             views: list[torch.Tensor]) -> None:
        """Copy each reduced ``view`` (as stepped: clipped where clipping rewrote it)
        into the parameter's own gradient; a parameter with none is left to DDP."""
        for (param, local), view in zip(local_grads, views, strict=True):
            if local is not None:
                local.copy_(view)
                self._filled.append((param, local, view))

    def lend(self) -> None:
        """Just before DDP's finalize: each filled parameter's ``.grad`` becomes the
        bucket's view, which DDP's copy then skips."""
        filled, self._filled = self._filled, []
        for param, local, view in filled:
            if param.grad is local:
                param.grad = view
                self._lent.append((param, local, view))

    def give_back(self, *, recovering: bool = False) -> None:
        """Right after DDP's finalize: each lent ``.grad`` is its own tensor again.

        ``recovering``: at the start of a backward, after one whose end did not run (a
        final callback queued after the stepper's raised). The loop may have written
        the lent view since (``zero_grad(set_to_none=False)`` zeroes it), so the
        own tensor takes the view's values before it is given back."""
        self._filled = []
        lent, self._lent = self._lent, []
        for param, local, view in lent:
            if param.grad is view:
                if recovering:
                    local.copy_(view)
                param.grad = local
