"""The rank side of tests/test_step_accounting.py: gradient accumulation written for a
plain optimizer (several backwards, then one ``step()``) without ``no_sync()``, under
DDP on 2 gloo ranks — refused, never silent — and the loops that must not be refused."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

#: how each case builds its optimizer on the DDP model
SETUPS: dict[str, Callable[[DDP], Any]] = {
    "overlap_ddp": lambda ddp: overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=0.01),
    "overlap_ddp comm thread": lambda ddp: overlapkit.overlap_ddp(
        ddp, torch.optim.AdamW, lr=0.01, step_thread="comm"),
    "overlap_ddp global clipping": lambda ddp: overlapkit.overlap_ddp(
        ddp, torch.optim.AdamW, lr=0.01, clip_grad_norm=0.1),
    "optimizer_in_backward": lambda ddp: overlapkit.optimizer_in_backward(
        ddp, torch.optim.AdamW, lr=0.01),
}


def _model() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                             nn.Linear(32, 4)), bucket_cap_mb=0.001)


def _backward(ddp: DDP, x: torch.Tensor) -> None:
    ddp(x).square().mean().backward()


def _refused_after_step(rank: int, make: Callable[[DDP], Any]) -> dict[str, Any]:
    """A loop that has shown it calls step(): a second backward before the next step()
    is refused before anything steps in it."""
    ddp = _model()
    opt = make(ddp)
    batches = rank_batches(rank, 5)
    _backward(ddp, batches[0])
    opt.step()
    opt.zero_grad()
    _backward(ddp, batches[1])  # steps
    after = values(ddp.module)
    error = error_of(lambda: _backward(ddp, batches[2]))
    unchanged = compare(after, values(ddp.module))
    # the ranks are still in step: a collective right after meets its match
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    opt.step()
    opt.zero_grad()
    _backward(ddp, batches[3])  # the loop goes on
    return {"error": error, "unchanged": unchanged,
            "moved after": not compare(after, values(ddp.module))}


def _first_window(rank: int, make: Callable[[DDP], Any]) -> dict[str, Any]:
    """Accumulation from the first iteration on: the loop's shape is unknown until its
    first step(), which raises."""
    ddp = _model()
    opt = make(ddp)
    batches = rank_batches(rank, 3)
    _backward(ddp, batches[0])
    _backward(ddp, batches[1])
    return {"error": error_of(opt.step)}


def _accepted(rank: int, make: Callable[[DDP], Any]) -> dict[str, Any]:
    """Loops that must not be refused: zero_grad() alone after each backward; a
    step() and zero_grad() before any backward (set-up code) followed by a
    backward-only loop; a backward-only loop clearing gradients now and then."""
    out: dict[str, Any] = {}
    batches = rank_batches(rank, 6)
    ddp = _model()
    opt = make(ddp)
    out["zero_grad loop"] = error_of(lambda: [(_backward(ddp, x), opt.zero_grad())
                                              for x in batches])
    ddp = _model()
    opt = make(ddp)
    opt.zero_grad()
    opt.step()
    out["set-up step, then backward only"] = error_of(
        lambda: [_backward(ddp, x) for x in batches])
    ddp = _model()
    opt = make(ddp)

    def occasional_zero_grad() -> None:
        for index, x in enumerate(batches):
            _backward(ddp, x)
            if index % 3 == 2:
                opt.zero_grad()

    out["backward only, zero_grad every 3"] = error_of(occasional_zero_grad)
    return out


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, make in SETUPS.items():
        out[name] = {"refused": _refused_after_step(rank, make),
                     "first window": _first_window(rank, make),
                     "accepted": _accepted(rank, make)}
    return out
