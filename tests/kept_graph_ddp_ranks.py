"""The rank side of tests/test_kept_graph_ddp.py: a DDP loop (2 gloo ranks) running two
backwards through one graph kept with ``retain_graph=True`` before ``step()``, under
``optimizer_in_backward`` learnt (``learn_first_step``): what was raised, and whether
the parameters changed."""

from __future__ import annotations

from typing import Any

import torch
from helpers import error_of, rank_batches
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


def run(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)))
    opt = overlapkit.optimizer_in_backward(ddp, torch.optim.SGD, lr=0.1)
    opt.learn_first_step(ddp)
    before = [p.detach().clone() for p in ddp.parameters()]
    loss = ddp(rank_batches(rank, 1)[0]).square().sum()
    loss.backward(retain_graph=True)
    error = error_of(loss.backward)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, ddp.parameters(), strict=True))
    return {"error": error, "unchanged": unchanged}
