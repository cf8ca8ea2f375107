"""The rank side of tests/test_window_storage.py: a DDP loop (2 gloo ranks, 4 steps,
SGD with momentum and AdamW) that writes the gradients or the parameters between
backward and ``step()`` through their storage (a tensor set on ``untyped_storage()``,
the storage's ``copy_``, a tensor ``set_`` on the gradient itself, torch's legacy
``to_dlpack`` capsule), or only reads it,
plainly and under each technique, learnt (``learn_first_step``) or not: what was raised
where, the values, the largest difference from the plain loop after each step, the
warnings."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.dlpack
from helpers import compare, error_of, max_diff, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


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


def _loop(rank: int, technique: str | None, window: Callable[[DDP, Any, int], None],
          learn: bool, optimizer: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)),
              bucket_cap_mb=0.001)
    settings = {"lr": 0.1, "momentum": 0.9} if optimizer is torch.optim.SGD else {"lr": 1e-2}
    if technique is None:
        opt: Any = optimizer(ddp.parameters(), **settings)
    else:
        opt = getattr(overlapkit, technique)(ddp, optimizer, **settings)
        if learn:
            opt.learn_first_step(ddp)
    found: dict[str, Any] = {"error": None, "at": None, "after": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, batch in enumerate(rank_batches(rank, 4)):
            found["error"] = error_of(lambda: ddp(batch).square().mean().backward())  # noqa: B023
            if found["error"] is None:
                window(ddp, opt, i)
                found["error"] = error_of(opt.step)
            if found["error"] is not None:
                found["at"] = i
                break
            opt.zero_grad()
            found["after"].append(values(ddp))
    found["values"] = values(ddp)
    found["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return found


def run(rank: int, world_size: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for optimizer in (torch.optim.SGD, torch.optim.AdamW):
        for name, window in WINDOWS.items():
            plain = _loop(rank, None, window, False, optimizer)
            assert plain["error"] is None, plain
            for technique in ("overlap_ddp", "optimizer_in_backward"):
                for learn in (False, True):
                    ours = _loop(rank, technique, window, learn, optimizer)
                    ours["bitwise plain"] = compare(plain["values"], ours.pop("values"))
                    ours["off"] = [max_diff(a, b) for a, b in
                                   zip(plain["after"], ours.pop("after"), strict=False)]
                    key = f"{optimizer.__name__} {technique} {name}{' learnt' if learn else ''}"
                    found[key] = ours
    return found
