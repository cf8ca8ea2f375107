"""The rank side of tests/test_grad_scaler.py."""

from __future__ import annotations

from typing import Any

import torch
from helpers import error_of, rank_batches
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)))
        opt = getattr(overlapkit, technique)(ddp, torch.optim.SGD, lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(ddp(rank_batches(rank, 1)[0]).square().mean()).backward()
        out[technique] = error_of(lambda opt=opt, scaler=scaler: scaler.step(opt))
        # the refusal leaves no GradScaler attributes behind: a plain step works
        out[f"{technique} plain step after"] = error_of(opt.step)
    return out
