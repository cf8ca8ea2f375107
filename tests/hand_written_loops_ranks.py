"""The rank side of tests/test_hand_written_loops.py: ``optimizer_in_backward`` on a DDP
model (2 gloo ranks) whose last forward leaves a branch unused, with
``find_unused_parameters`` off (DDP never reduces the bucket) and on (bitwise); and one
whose last forward calls the wrapped module past DDP (nothing reduced)."""

from __future__ import annotations

from typing import Any

import torch
from helpers import compare, error_of, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        return self.b(self.a(x)) if use_b else self.a(x)


def _train(rank: int, overlapped: bool, find_unused: bool) -> dict[str, Any]:
    model = _TwoLayers()
    ddp = DDP(model, find_unused_parameters=find_unused)
    opt: Any = (overlapkit.optimizer_in_backward(ddp, torch.optim.Adam, lr=0.01)
                if overlapped else torch.optim.Adam(model.parameters(), lr=0.01))
    generator = torch.Generator().manual_seed(rank)
    errors, before_last = [], values(model)
    for step in range(3):
        batch = torch.randn(4, 8, generator=generator)
        if step == 2:
            before_last = values(model)
        errors.append(error_of(ddp(batch, use_b=step != 2).square().mean().backward))
        opt.step()
        opt.zero_grad()
    return {"values": values(model), "errors": errors, "before last": before_last}


def _past_ddp(rank: int) -> dict[str, Any]:
    """Two steps through DDP, then a training forward of ``ddp.module``: refused as its
    backward ends, nothing stepped in it."""
    model = _TwoLayers()
    ddp = DDP(model)
    opt = overlapkit.optimizer_in_backward(ddp, torch.optim.Adam, lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):
        ddp(torch.randn(4, 8, generator=generator)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    before = values(model)
    error = error_of(model(torch.randn(4, 8, generator=generator)).square().mean().backward)
    return {"error": error, "stepped nothing": compare(before, values(model))}


def run(rank: int, world_size: int) -> dict[Any, dict[str, Any]]:
    out: dict[Any, dict[str, Any]] = {"past ddp": _past_ddp(rank)}
    for find_unused in (False, True):
        plain, mine = _train(rank, False, find_unused), _train(rank, True, find_unused)
        out[find_unused] = {
            "errors": mine["errors"], "plain errors": plain["errors"],
            "bitwise": compare(plain["values"], mine["values"]),
            "last backward stepped nothing": compare(mine["before last"], mine["values"])}
    return out
