"""Averaging a bucket as plain DDP averages it when gradients are kept as bucket views.

Plain DDP (no comm hook) averages each parameter's gradient in one of two ways
(``Reducer::mark_variable_ready_dense``, torch 2.13):

- the gradient is a tensor of its own (the usual case; always with
  ``gradient_as_bucket_view=False``): it is *multiplied* by the inverse of the group
  size while copied into the bucket — what the ``allreduce`` hook does
  (:func:`overlapkit.comm_hooks.allreduce_hook`);
- with ``gradient_as_bucket_view=True``, a gradient that was still set when its
  backward reached it (``zero_grad(set_to_none=False)``, or a parameter no optimizer
  zeroes) already *is* the bucket's view, and backward accumulated into it in place:
  DDP *divides* that view by the group size.

For a group whose size is a power of two both give the same bits. For another size (3,
6, 12 ranks) they differ in the last bit, and a comm hook sees only the bucket. So
where it matters — ``gradient_as_bucket_view=True`` at such a size — the stepper notes,
for each parameter, whether its gradient was a bucket view when backward reached it (a
hook on the parameter, run before autograd accumulates into ``.grad``), and divides
those views, multiplying the others (measured on torch 2.13, 3 gloo ranks: bitwise plain
DDP in both cases, ``tests/test_engine_caching.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from overlapkit.overlap.core.bucket_layout import bucket_gradient_views

__all__ = ["KeptGradientAveraging"]


def _power_of_two(size: int) -> bool:
    return size & (size - 1) == 0


class KeptGradientAveraging:
    """How each bucket is averaged on a ``gradient_as_bucket_view=True`` DDP model over
    a group whose size is not a power of two (see the module docstring).

    Build it with :meth:`for_model`, which says whether one is needed; the stepper
    passes :meth:`average` to :func:`overlapkit.comm_hooks.launch_allreduce`.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        #: id(parameter) -> its gradient's data pointer when backward reached it (0: none)
        self._before: dict[int, int] = {}
        for param in params:  # for the model's life, as the comm hook
            param.register_hook(self._noter(param))

    @classmethod
    def for_model(cls, model: DistributedDataParallel) -> KeptGradientAveraging | None:
        """One for ``model`` where plain DDP may divide kept gradients at a size the
        ``allreduce`` hook's multiplication does not match; else None."""
        size = dist.get_world_size(model.process_group)
        if not model.gradient_as_bucket_view or size == 1 or _power_of_two(size):
            return None
        return cls([p for p in model.parameters() if p.requires_grad])

    def _noter(self, param: torch.Tensor) -> Any:
        before = self._before

        def note(grad: torch.Tensor) -> None:
            kept = param.grad
            before[id(param)] = 0 if kept is None else kept.data_ptr()

        return note

    def average(self, bucket: dist.GradBucket, size: int) -> None:
        """Average ``bucket``'s buffer (before its sum over the group) as plain DDP
        would have: divide the gradients that were bucket views, multiply the others."""
        buffer = bucket.buffer()
        params = bucket.parameters()
        views = bucket_gradient_views(buffer, params)
        before = self._before
        kept = []
        for param, view in zip(params, views, strict=True):
            # a parameter backward did not reach (unused) still holds what it held
            noted = before.pop(id(param), None)
            if noted is None:
                grad = param.grad
                noted = 0 if grad is None else grad.data_ptr()
            kept.append(noted == view.data_ptr() and view.numel() > 0)
        if not any(kept):
            buffer.mul_(1.0 / size)
        elif all(kept):
            buffer.div_(size)
        else:
            for view, divided in zip(views, kept, strict=True):
                if divided:
                    view.div_(size)
                else:
                    view.mul_(1.0 / size)
