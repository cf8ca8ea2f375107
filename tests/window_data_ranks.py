"""The rank side of tests/test_window_data.py: a DDP loop (2 gloo ranks, SGD with
momentum, 3 steps) that writes gradients or parameters through ``.data`` between
backward and ``step()``, or runs a forward there (a validation), plainly and under each
technique, learnt (``learn_first_step``) or not: what was raised where, the values, the
warnings."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


def _grads_halved(ddp: DDP) -> None:
    for param in ddp.parameters():
        if param.grad is not None:
            param.grad.data.mul_(0.5)  # bumps no version counter of .grad


def _weights_clamped(ddp: DDP) -> None:
    for param in ddp.parameters():
        param.data.clamp_(-0.1, 0.1)  # bumps no version counter of the parameter


def _weights_set(ddp: DDP) -> None:
    for param in ddp.parameters():
        param.data = param.data.clamp(-0.1, 0.1)


def _grad_norms_read(ddp: DDP) -> None:
    for param in ddp.parameters():
        if param.grad is not None:
            float(param.grad.data.norm())


def _moved_to_its_device(ddp: DDP) -> None:
    ddp.to("cpu")  # sets each .data to the same tensor: no change
    ddp.double().float()  # to other values and back: no change


def _validated(ddp: DDP) -> None:
    with torch.no_grad():
        ddp.eval()
        ddp(torch.ones(2, 16))
        ddp.train()


def _validated_with_autograd(ddp: DDP) -> None:
    ddp.eval()
    ddp(torch.ones(2, 16))
    ddp.train()


WINDOWS: dict[str, Callable[[DDP], None]] = {
    "grads halved through data": _grads_halved,
    "weights clamped through data": _weights_clamped,
    "weights set through data": _weights_set,
    "grad norms read through data": _grad_norms_read,
    "moved to its device": _moved_to_its_device,
    "validated under no_grad": _validated,
    "validated with autograd": _validated_with_autograd,
}


def _loop(rank: int, technique: str | None, window: Callable[[DDP], None],
          learn: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)),
              bucket_cap_mb=0.001)
    if technique is None:
        opt: Any = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = getattr(overlapkit, technique)(ddp, torch.optim.SGD, lr=0.1, momentum=0.9)
        if learn:
            opt.learn_first_step(ddp)
    found: dict[str, Any] = {"error": None, "at": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, batch in enumerate(rank_batches(rank, 3)):
            ddp(batch).square().mean().backward()
            window(ddp)
            found["error"] = error_of(opt.step)
            if found["error"] is not None:
                found["at"] = i
                break
            opt.zero_grad()
    found["values"] = values(ddp)
    found["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return found


def _backward_only(rank: int, technique: str | None) -> list[torch.Tensor]:
    """A backward-only loop (the plain one: backward, step(), zero_grad()) validating
    under ``no_grad()`` after each backward: the next forward with autograd still
    clears the gradients stepped."""
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)),
              bucket_cap_mb=0.001)
    opt: Any = (torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9) if technique is None
                else getattr(overlapkit, technique)(ddp, torch.optim.SGD, lr=0.1, momentum=0.9))
    for batch in rank_batches(rank, 3):
        ddp(batch).square().mean().backward()
        if technique is None:
            opt.step()
            opt.zero_grad()
        _validated(ddp)
    return values(ddp)


def run(rank: int, world_size: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    expected = _backward_only(rank, None)
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        found[f"{technique} backward only, validated"] = compare(
            expected, _backward_only(rank, technique))
    for name, window in WINDOWS.items():
        plain = _loop(rank, None, window, False)
        assert plain["error"] is None, plain
        for technique in ("overlap_ddp", "optimizer_in_backward"):
            for learn in (False, True):
                ours = _loop(rank, technique, window, learn)
                ours["bitwise plain"] = compare(plain["values"], ours.pop("values"))
                found[f"{technique} {name}{' learnt' if learn else ''}"] = ours
    return found
