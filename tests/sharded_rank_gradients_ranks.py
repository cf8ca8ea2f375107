"""The rank side of tests/test_sharded_rank_gradients.py: a full ``step()`` of a sharded
optimizer (2 gloo ranks, AdamW) with gradients that differ between ranks, against the
plain loop, and the same with gradients the loop reduced by hand."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from helpers import error_of, rank_batches
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

CASES = ("autograd.grad", "no_sync only", "per-rank noise, learnt", "autograd.grad reduced")


def _iteration(case: str, ddp: DDP, opt: Any, batch: torch.Tensor, rank: int,
               noise: torch.Generator) -> None:
    params = list(ddp.parameters())
    if case.startswith("autograd.grad"):
        grads = torch.autograd.grad(ddp(batch).square().mean(), params)
        for param, grad in zip(params, grads, strict=True):
            if case.endswith("reduced"):
                grad = grad.clone()
                dist.all_reduce(grad)
                grad /= dist.get_world_size()
            param.grad = grad
    elif case == "no_sync only":
        with ddp.no_sync():
            ddp(batch).square().mean().backward()
    else:
        ddp(batch).square().mean().backward()
        for param in params:
            param.grad.add_(torch.randn(param.shape, generator=noise) * 1e-3)
    opt.step()
    opt.zero_grad()


def _loop(rank: int, case: str, sharded: bool) -> tuple[list[torch.Tensor], Any]:
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)),
              bucket_cap_mb=0.001)
    if sharded:
        opt: Any = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=1e-2,
                                          shard_optimizer_state=True)
        if "learnt" in case:
            opt.learn_first_step(ddp)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    noise = torch.Generator().manual_seed(1000 + rank)
    error = None
    for batch in rank_batches(rank, 4):
        before = [p.detach().clone() for p in ddp.parameters()]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            error = error_of(lambda: _iteration(case, ddp, opt, batch, rank, noise))  # noqa: B023
        if error is not None:
            error["unchanged"] = all(torch.equal(a, b) for a, b in
                                     zip(before, ddp.parameters(), strict=True))
            break
    return [p.detach().clone() for p in ddp.parameters()], error


def run(rank: int, world_size: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for case in CASES:
        plain, _ = _loop(rank, case, False)
        params, error = _loop(rank, case, True)
        found[case] = {"error": error, "equal": all(
            torch.equal(a, b) for a, b in zip(plain, params, strict=True))}
    return found
