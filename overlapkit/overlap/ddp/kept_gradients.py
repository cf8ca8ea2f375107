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
where it matters — ``gradient_as_bucket_view=True`` at such a size — the stepper notes
what DDP tests (``grad.is_alias_of(bucket_view)``, once backward has accumulated into
``.grad``), and divides those views, multiplying the others:

- for a parameter backward reaches, a hook run right after autograd accumulated its
  gradient, before DDP's own hook (an out-of-place accumulation, under
  ``create_graph=True``, leaves a gradient of its own: multiplied, as DDP does);
- for a parameter it does not reach (unused, ``find_unused_parameters=True``), DDP
  tests it when backward reaches the first parameter: the first such hook of each
  backward notes every parameter's gradient then.

Measured on torch 2.13, 3 gloo ranks: bitwise plain DDP in each case
(``tests/test_engine_caching.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Variable
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
        self._params = params
        #: id(parameter) -> its gradient's data pointer when DDP tested it (0: none)
        self._tested: dict[int, int] = {}
        #: no hook has run yet in the current backward
        self._first = True
        for param in params:  # for the model's life, as the comm hook
            param.register_post_accumulate_grad_hook(self._note)

    @classmethod
    def for_model(cls, model: DistributedDataParallel) -> KeptGradientAveraging | None:
        """One for ``model`` where plain DDP may divide kept gradients at a size the
        ``allreduce`` hook's multiplication does not match; else None."""
        size = dist.get_world_size(model.process_group)
        if not model.gradient_as_bucket_view or size == 1 or _power_of_two(size):
            return None
        return cls([p for p in model.parameters() if p.requires_grad])

    def _note(self, param: torch.Tensor) -> None:
        tested = self._tested
        if self._first:  # DDP tests the parameters backward will not reach now
            self._first = False
            tested.clear()
            for each in self._params:
                grad = each.grad
                tested[id(each)] = 0 if grad is None else grad.data_ptr()
            Variable._execution_engine.queue_callback(self._backward_ended)
        grad = param.grad
        tested[id(param)] = 0 if grad is None else grad.data_ptr()

    def _backward_ended(self) -> None:
        self._first = True

    def average(self, bucket: dist.GradBucket, size: int) -> None:
        """Average ``bucket``'s buffer (before its sum over the group) as plain DDP
        would have: divide the gradients that were bucket views, multiply the others."""
        buffer = bucket.buffer()
        params = bucket.parameters()
        views = bucket_gradient_views(buffer, params)
        tested = self._tested
        kept = [view.numel() > 0 and tested.get(id(param), 0) == view.data_ptr()
                for param, view in zip(params, views, strict=True)]
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
