"""The rank side of tests/test_join_divide.py: ``ddp_model.join()`` with uneven inputs
(rank 0 has 3 batches, rank 1 has 5), each technique against the plain DDP loop."""

from __future__ import annotations

from typing import Any

import torch
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


def _train(rank: int, technique: str, divide: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = DDP(model)
    settings = {"lr": 0.01, "weight_decay": 0.1}
    opt: Any = (torch.optim.AdamW(model.parameters(), **settings) if technique == "plain"
                else getattr(overlapkit, technique)(ddp, torch.optim.AdamW, **settings))
    initial = values(model)

    def steps() -> None:
        with ddp.join(divide_by_initial_world_size=divide):
            for batch in rank_batches(rank, 3 + 2 * rank):
                ddp(batch).square().mean().backward()
                opt.step()
                opt.zero_grad()

    error = error_of(steps)
    return {"error": error, "values": values(model), "unchanged": compare(initial, values(model)),
            "state": len(opt.state), "grads": [p.grad for p in model.parameters()]}


def run(rank: int, world_size: int) -> dict[tuple[str, bool], dict[str, Any]]:
    """Each technique, by the initial world size and by the remaining ranks."""
    out = {}
    for divide in (True, False):
        plain = _train(rank, "plain", divide)
        for technique in ("overlap_ddp", "optimizer_in_backward"):
            got = _train(rank, technique, divide)
            got["equal"] = compare(plain["values"], got["values"])
            got["plain error"] = plain["error"]
            out[technique, divide] = got
    return out
