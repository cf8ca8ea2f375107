"""The rank side of tests/test_compiled.py: torch.compile'd modules (``aot_eager``: the
real dynamo + AOTAutograd path, no C++ toolchain needed) under each technique."""

from __future__ import annotations

from typing import Any

import torch
from helpers import compare, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 4


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _train(ddp: nn.Module, opt: Any, rank: int) -> list[torch.Tensor]:
    for x in rank_batches(rank, STEPS):
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return values(ddp)


def run(rank: int, world_size: int) -> dict[str, Any]:
    torch._dynamo.reset()
    plain = DDP(torch.compile(model(), backend="aot_eager"))
    expected = _train(plain, torch.optim.AdamW(plain.parameters(), lr=0.01), rank)
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        ddp = DDP(torch.compile(model(), backend="aot_eager"))
        opt = getattr(overlapkit, technique)(ddp, torch.optim.AdamW, lr=0.01)
        out[technique] = compare(expected, _train(ddp, opt, rank))
    return out
