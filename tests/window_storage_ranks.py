"""The rank side of tests/test_window_storage.py: a DDP loop (2 gloo ranks, 4 steps,
SGD with momentum and AdamW) that writes the gradients or the parameters between
backward and ``step()`` through their storage (a tensor set on ``untyped_storage()``,
the storage's ``copy_``, a tensor ``set_`` on the gradient itself, torch's legacy
``to_dlpack`` capsule), or only reads it,
plainly and under each technique, learnt (``learn_first_step``) or not: what was raised
where, the values, the largest difference from the plain loop after each step, the
warnings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.dlpack
from torch.nn.parallel import DistributedDataParallel as DDP
from window_freed_grads_ranks import run_windows


def _over(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor with a version counter of its own over ``tensor``'s storage."""
    return torch.tensor([], dtype=tensor.dtype).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


def _grads_halved_over_storage(ddp: DDP, opt: Any, step: int) -> None:
    for param in ddp.parameters():
        if param.grad is not None:
            _over(param.grad).mul_(0.5)


def _grads_halved_by_storage_copy(ddp: DDP, opt: Any, step: int) -> None:
    for param in ddp.parameters():
        if param.grad is not None:
            param.grad.untyped_storage().copy_((param.grad * 0.5).untyped_storage())


def _grads_halved_over_set(ddp: DDP, opt: Any, step: int) -> None:
    for param in ddp.parameters():
        if param.grad is not None:
            torch.empty(0).set_(param.grad).mul_(0.5)


def _grads_halved_over_legacy_dlpack(ddp: DDP, opt: Any, step: int) -> None:
    for param in ddp.parameters():
        if param.grad is not None:  # a capsule, not __dlpack__
            torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(param.grad)).mul_(0.5)


def _weights_scaled_over_storage(ddp: DDP, opt: Any, step: int) -> None:
    for param in ddp.parameters():
        _over(param).mul_(0.9)


def _storage_read(ddp: DDP, opt: Any, step: int) -> None:
    for param in ddp.parameters():
        float(_over(param).sum())
        if param.grad is not None:
            float(_over(param.grad).sum())


WINDOWS: dict[str, Callable[[DDP, Any, int], None]] = {
    "grads halved over storage": _grads_halved_over_storage,
    "grads halved by storage copy": _grads_halved_by_storage_copy,
    "grads halved over set": _grads_halved_over_set,
    "grads halved over legacy dlpack": _grads_halved_over_legacy_dlpack,
    "weights scaled over storage": _weights_scaled_over_storage,
    "storage read": _storage_read,
}


def run(rank: int, world_size: int) -> dict[str, Any]:
    return run_windows(rank, WINDOWS)
