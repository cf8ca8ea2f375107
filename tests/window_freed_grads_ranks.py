"""The rank side of tests/test_window_freed_grads.py: a DDP loop (2 gloo ranks, 4
steps, SGD with momentum and AdamW) that reads or changes the gradients between backward
and ``step()`` (``optimizer_in_backward`` has freed them), drops a parameter from its
param group there, or writes gradients, parameters or state through ``numpy()``
or DLPack, plainly
and under each technique, learnt (``learn_first_step``) or not: what was raised where,
the values, the largest difference from the plain loop after each step, the warnings."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy
import torch
from helpers import compare, error_of, max_diff, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


def _grads_halved(ddp: DDP, opt: Any, step: int) -> None:
    for param in ddp.parameters():
        if param.grad is not None:  # a defensive edit: None where freed
            param.grad.mul_(0.5)


def _grad_noise(ddp: DDP, opt: Any, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for param in ddp.parameters():
        if param.grad is not None:
            param.grad.add_(torch.randn(param.shape, generator=generator), alpha=0.01)


def _grads_logged(ddp: DDP, opt: Any, step: int) -> None:
    logged = [param.grad for param in ddp.parameters()]
    del logged


def _last_dropped(ddp: DDP, opt: Any, step: int) -> None:
    if step == 1:  # freezing the last layer: dropped from its group by identity
        last = list(ddp.parameters())[-1]
        group = opt.param_groups[0]
        group["params"] = [p for p in group["params"] if p is not last]


def _last_removed(ddp: DDP, opt: Any, step: int) -> None:
    if step == 1:  # the same, the list kept
        group = opt.param_groups[0]
        del group["params"][-1]


def _grads_halved_through_numpy(ddp: DDP, opt: Any, step: int) -> None:
    for param in ddp.parameters():
        if param.grad is not None:
            param.grad.numpy()[...] *= 0.5  # bumps no version counter


def _weights_scaled_through_numpy(ddp: DDP, opt: Any, step: int) -> None:
    for param in ddp.parameters():
        param.detach().numpy()[...] *= 0.9


def _state_halved_through_numpy(ddp: DDP, opt: Any, step: int) -> None:
    if step == 1:
        for param in ddp.parameters():
            for value in opt.state[param].values():
                if value.dim():  # a moment, not the step count
                    value.numpy()[...] *= 0.5


def _grads_halved_through_dlpack(ddp: DDP, opt: Any, step: int) -> None:
    for param in ddp.parameters():
        if param.grad is not None:  # a tensor with a version counter of its own
            torch.from_dlpack(param.grad).mul_(0.5)


def _weights_scaled_through_dlpack(ddp: DDP, opt: Any, step: int) -> None:
    for param in ddp.parameters():
        numpy.from_dlpack(param.detach())[...] *= 0.9


def _read_through_numpy(ddp: DDP, opt: Any, step: int) -> None:
    for param in ddp.parameters():
        float(param.detach().numpy().sum())
        if param.grad is not None:
            param.grad.numpy().copy()


WINDOWS: dict[str, Callable[[DDP, Any, int], None]] = {
    "grads halved": _grads_halved,
    "grad noise": _grad_noise,
    "grads logged": _grads_logged,
    "last parameter dropped": _last_dropped,
    "last parameter removed": _last_removed,
    "grads halved through numpy": _grads_halved_through_numpy,
    "weights scaled through numpy": _weights_scaled_through_numpy,
    "state halved through numpy": _state_halved_through_numpy,
    "read through numpy": _read_through_numpy,
    "grads halved through dlpack": _grads_halved_through_dlpack,
    "weights scaled through dlpack": _weights_scaled_through_dlpack,
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


def run_windows(rank: int, windows: Mapping[str, Callable[[DDP, Any, int], None]]
                ) -> dict[str, Any]:
    """Each window's loop, plainly and under each technique, learnt or not, with SGD
    (momentum) and AdamW: what :func:`_loop` found, against the plain loop (also the
    rank side of tests/test_window_storage.py)."""
    found: dict[str, Any] = {}
    for optimizer in (torch.optim.SGD, torch.optim.AdamW):
        for name, window in windows.items():
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


def run(rank: int, world_size: int) -> dict[str, Any]:
    return run_windows(rank, WINDOWS)
