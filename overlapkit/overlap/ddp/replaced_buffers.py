"""A comm hook that replaces its bucket's buffer (``bucket.set_buffer``): the bucket
stepped from the buffer DDP gave it, as plain DDP does.

torch's ``fp16_compress_wrapper(hook)`` and ``bf16_compress_wrapper(hook)`` (the
documented way to run PowerSGD in half precision) call ``bucket.set_buffer`` with the
half-precision copy, run the inner hook on it and return the reduced half-precision
tensor. Plain DDP copies that tensor into its own bucket (cast to the parameters'
dtype); the GradBucket's replaced buffer is not DDP's. At ``cdd1705`` overlapkit read
the replaced buffer when stepping and the first backward failed with torch's bare
"attempting to assign a gradient with dtype 'c10::Half' to a tensor with grad_dtype
'Float'". Here the buffer DDP gave the hook is noted when the hook replaced it, and
put back once the hook's future completed (its callbacks, which may read the replaced
one, have run), and the reduced tensor is copied into it, cast, as plain DDP does.

Cost: one ``bucket.buffer()`` and a pointer comparison per bucket for a hook other
than overlapkit's ``allreduce`` (which takes its own path), measured below 1 us.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["call_hook", "original_buffer"]


def call_hook(stepper: Any, bucket: dist.GradBucket) -> torch.futures.Future[Any]:
    """Run ``stepper``'s inner comm hook on ``bucket``, noting the buffer DDP gave it
    if the hook replaced it."""
    buffer = bucket.buffer()
    future = stepper.inner_hook(stepper.inner_state, bucket)
    replaced: dict[int, torch.Tensor] | None = stepper.__dict__.get("_replaced_buffers")
    if replaced is not None:
        replaced.pop(bucket.index(), None)  # one of an earlier backward: not this one's
    if bucket.buffer().data_ptr() != buffer.data_ptr():
        if replaced is None:
            replaced = stepper.__dict__.setdefault("_replaced_buffers", {})
        replaced[bucket.index()] = buffer
    return future


def original_buffer(stepper: Any, bucket: dist.GradBucket) -> torch.Tensor:
    """The buffer to step ``bucket`` from, once its future completed: the one DDP gave
    the hook (put back into the bucket) if the hook replaced it, else the bucket's."""
    replaced: dict[int, torch.Tensor] | None = stepper.__dict__.get("_replaced_buffers")
    buffer = replaced.pop(bucket.index(), None) if replaced else None
    if buffer is None:
        return bucket.buffer()
    bucket.set_buffer(buffer)
    return buffer
