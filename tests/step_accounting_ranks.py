"""The rank side of tests/test_step_accounting.py: two backwards with no step() or
zero_grad() between them, under DDP (2 gloo ranks)."""

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


def _case(rank: int, make: Callable[[DDP], Any]) -> dict[str, Any]:
    ddp = _model()
    opt = make(ddp)
    batches = rank_batches(rank, 4)
    ddp(batches[0]).square().mean().backward()  # steps
    after_first = values(ddp.module)
    error = error_of(lambda: ddp(batches[1]).square().mean().backward())
    unchanged = compare(after_first, values(ddp.module))
    # the ranks are still in step: a collective right after meets its match
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    # a loop that ends each iteration with zero_grad() alone is not refused
    opt.zero_grad()
    zero_grad_loop = error_of(lambda: ddp(batches[2]).square().mean().backward())
    opt.zero_grad()
    moved = not compare(after_first, values(ddp.module))
    return {"error": error, "unchanged": unchanged, "zero_grad loop": zero_grad_loop,
            "moved": moved}


def run(rank: int, world_size: int) -> dict[str, Any]:
    return {name: _case(rank, make) for name, make in SETUPS.items()}
