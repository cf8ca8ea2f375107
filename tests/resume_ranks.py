"""The rank side of tests/test_resume.py: save in the middle of training, load into a
fresh model and optimizer, go on — against the uninterrupted run, bitwise — on models
with what real ones have: BatchNorm buffers under DDP, a head that gets no gradient,
an output the loss ignores (``find_unused_parameters=True``), an LR scheduler."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, named_values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS, SAVE_AT = 6, 3


class ConvBN(nn.Module):
    """A small conv net with BatchNorm (running statistics differ per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


class TwoOutputs(nn.Module):
    """A trunk, a head the loss uses, and a pooler whose output is returned but ignored
    by the loss (BERT's), plus a head never called at all."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.pooler = nn.Linear(8, 8)
        self.never = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.trunk(x))
        return self.head(hidden), torch.tanh(self.pooler(hidden))


def _batch(kind: str, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * rank + step)
    shape = (4, 3, 6, 6) if kind == "bn" else (4, 8)
    return torch.randn(*shape, generator=generator) * (1 + rank)


def _build(kind: str, seed: int = 0) -> DDP:
    torch.manual_seed(seed)
    if kind == "bn":
        return DDP(ConvBN(), broadcast_buffers=True)
    return DDP(TwoOutputs(), find_unused_parameters=True, bucket_cap_mb=0.0001)


def _optimizer(technique: str, model: DDP) -> Any:
    if technique == "plain":
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return getattr(overlapkit, technique)(model, torch.optim.AdamW, lr=0.01, weight_decay=0.1)


def _steps(kind: str, model: DDP, opt: Any, sched: Any, rank: int, steps: range) -> None:
    for step in steps:
        out = model(_batch(kind, rank, step))
        (out[0] if isinstance(out, tuple) else out).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _run(kind: str, technique: str, rank: int, directory: str | None) -> dict[str, Any]:
    model = _build(kind)
    opt = _optimizer(technique, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if directory is None:
        _steps(kind, model, opt, sched, rank, range(STEPS))
        return {"values": named_values(model.module), "state": len(opt.state)}
    _steps(kind, model, opt, sched, rank, range(SAVE_AT))
    path = os.path.join(directory, f"{kind}-{technique}")
    overlapkit.checkpoint.save(path, model, opt)
    sched_state = sched.state_dict()
    fresh = _build(kind, seed=7)
    fresh_opt = _optimizer(technique, fresh)
    overlapkit.checkpoint.load(path, fresh, fresh_opt)  # before the scheduler exists
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2, gamma=0.5)
    fresh_sched.load_state_dict(sched_state)
    no_state = [n for n, p in fresh.module.named_parameters() if p not in fresh_opt.state]
    _steps(kind, fresh, fresh_opt, fresh_sched, rank, range(SAVE_AT, STEPS))
    return {"values": named_values(fresh.module), "state": len(fresh_opt.state),
            "no state after load": no_state}


def run(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("bn", "unused"):
        plain = _run(kind, "plain", rank, None)
        for technique in ("plain", "overlap_ddp", "optimizer_in_backward"):
            if technique != "plain":
                ours = _run(kind, technique, rank, None)
                out[f"{kind} {technique}"] = compare(plain["values"], ours["values"])
            resumed = _run(kind, technique, rank, directory)
            out[f"{kind} {technique} resumed"] = compare(plain["values"], resumed["values"])
            out[f"{kind} {technique} no state after load"] = resumed["no state after load"]
    dist.barrier()
    return out
