"""The rank side of tests/test_window.py: a gradient changed between a backward that
stepped it and ``step()`` is refused at that ``step()`` (2 gloo ranks, DDP)."""

from __future__ import annotations

from typing import Any

import torch
from helpers import error_of, rank_batches
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

EDITS = ("in place", "replaced", "none")


def _edited_after_stepping(rank: int, technique: str, edit: str) -> dict[str, Any] | None:
    """Two ordinary steps, then a third whose gradients the loop changes before step()."""
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)),
              bucket_cap_mb=0.001)
    build = getattr(overlapkit, technique)
    opt = build(ddp, torch.optim.AdamW, lr=1e-2)
    for batch in rank_batches(rank, 2):
        ddp(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ddp(rank_batches(rank, 3)[2]).square().mean().backward()
    weight = ddp.module[0].weight
    if edit == "in place" and weight.grad is not None:
        weight.grad.mul_(0.5)
    elif edit != "none":
        weight.grad = torch.zeros_like(weight)
    return error_of(opt.step)


def run(rank: int, world_size: int) -> dict[str, Any]:
    return {f"{technique} {edit}": _edited_after_stepping(rank, technique, edit)
            for technique in ("overlap_ddp", "optimizer_in_backward") for edit in EDITS}
