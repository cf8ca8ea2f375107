"""The rank side of tests/test_window_grad_identity.py: a DDP loop (2 gloo ranks) with the
hand-written ``zero_grad`` (``p.grad.detach_(); p.grad.zero_()``) before each forward,
under ``optimizer_in_backward`` learnt, against the plain loop."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from helpers import error_of, rank_batches
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


def _loop(rank: int, overlap: bool) -> tuple[DDP, dict[str, Any] | None]:
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)),
              bucket_cap_mb=0.001)
    if overlap:
        opt: Any = overlapkit.optimizer_in_backward(ddp, torch.optim.AdamW, lr=1e-2)
        opt.learn_first_step(ddp)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)

    def iteration(batch: torch.Tensor) -> None:
        for param in ddp.parameters():
            if param.grad is not None:
                param.grad.detach_()
                param.grad.zero_()
        ddp(batch).square().mean().backward()
        opt.step()

    for batch in rank_batches(rank, 4):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            error = error_of(lambda: iteration(batch))  # noqa: B023
        if error is not None:
            return ddp, error
    return ddp, None


def run(rank: int, world_size: int) -> dict[str, Any]:
    plain, _ = _loop(rank, False)
    ddp, error = _loop(rank, True)
    equal = all(torch.equal(a, b) for a, b in zip(plain.parameters(), ddp.parameters(),
                                                   strict=True))
    return {"error": error, "equal": equal}
