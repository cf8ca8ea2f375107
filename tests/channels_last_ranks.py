"""The rank side of tests/test_channels_last.py."""

from __future__ import annotations

from typing import Any

import torch
from helpers import compare, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    return model.to(memory_format=torch.channels_last)


def _train(ddp: DDP, opt: Any, rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(2, 3, 8, 8, generator=generator).to(memory_format=torch.channels_last)
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return values(ddp.module)


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for as_view in (False, True):
        plain = DDP(_model(), gradient_as_bucket_view=as_view, bucket_cap_mb=0.0001)
        expected = _train(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9),
                          rank)
        for technique in ("overlap_ddp", "optimizer_in_backward"):
            ddp = DDP(_model(), gradient_as_bucket_view=as_view, bucket_cap_mb=0.0001)
            opt = getattr(overlapkit, technique)(ddp, torch.optim.SGD, lr=0.1, momentum=0.9)
            out[f"{technique} bucket_view={as_view}"] = compare(expected, _train(ddp, opt, rank))
    return out
