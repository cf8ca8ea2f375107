"""The rank side of tests/test_sharded_agreement.py: ranks whose optimizers hold
different settings (``lr`` set on one rank only, an LR scheduler stepped on one rank
only) under ``overlap_ddp(..., shard_optimizer_state=True)``, against plain DDP + AdamW,
on 2 and 3 gloo ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, values
from sharded_state_ranks import LR, _loss, batches, build, build_reference

import overlapkit


def _pair() -> tuple[Any, Any, Any, Any]:
    ddp, reference = build(), build_reference()
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR, shard_optimizer_state=True)
    return ddp, opt, reference, torch.optim.AdamW(reference.parameters(), lr=LR)


def lr_on_one_rank(rank: int, world_size: int, how: str) -> dict[str, Any]:
    """``how``: "lr" (``param_groups[0]["lr"]`` doubled on rank 0 before the first
    backward) or "scheduler" (a StepLR stepped on rank 0 only after the first step):
    what the next backward raises, whether any parameter changed in it, then (the
    settings made equal again) 2 more steps against plain DDP + AdamW taking the same
    steps; then a full ``step()`` (backward under ``no_sync``, gradients reduced by
    hand) with ``lr`` changed on rank 0 only."""
    ddp, opt, reference, plain = _pair()
    data = batches(rank, 4)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    plain_scheduler = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    if how == "scheduler":  # one step on every rank, then the scheduler on rank 0 only
        for model, optimizer in ((ddp, opt), (reference, plain)):
            _loss(model, data[0]).backward()
            optimizer.step()
            optimizer.zero_grad()
        if rank == 0:
            scheduler.step()
    else:
        _loss(reference, data[0]).backward()  # (the same buckets' rebuild as ddp's)
        plain.zero_grad()
        if rank == 0:
            opt.param_groups[0]["lr"] = LR * 2
    before = values(ddp)
    out: dict[str, Any] = {"refused": error_of(lambda: _loss(ddp, data[1]).backward())}
    out["unchanged"] = compare(before, values(ddp))
    out["step"] = error_of(opt.step)
    opt.zero_grad()
    if how == "scheduler":
        if rank != 0:
            scheduler.step()  # now on every rank alike
        plain_scheduler.step()
        _loss(reference, data[1]).backward()
        plain.zero_grad()
    else:
        opt.param_groups[0]["lr"] = LR
    for tokens in data[2:]:
        for model, optimizer in ((ddp, opt), (reference, plain)):
            _loss(model, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
    out["values"] = compare(values(reference), values(ddp))
    if rank == 0:
        opt.param_groups[0]["lr"] = LR * 3
    with ddp.no_sync():
        _loss(ddp, data[0]).backward()
    for param in ddp.parameters():
        dist.all_reduce(param.grad)
    before = values(ddp)
    out["full step"] = error_of(opt.step)
    out["full step unchanged"] = compare(before, values(ddp))
    return out


def lr_on_one_rank_steps_elsewhere(rank: int, world_size: int, how: str) -> dict[str, Any]:
    """``lr`` changed on rank 0 only after 2 steps where the steps are taken at
    ``step()`` (``how``: "learnt", a loop reading the gradients in the window after
    ``learn_first_step``) or at the end of backward ("global clip"): what the next
    backward and ``step()`` raise, and whether any parameter changed."""
    ddp = build()
    options = {"clip_grad_norm": 0.05} if how == "global clip" else {}
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR, shard_optimizer_state=True,
                                 **options)
    if how == "learnt":
        opt.learn_first_step(ddp)
    data = batches(rank, 3)

    def one_step(tokens: torch.Tensor) -> tuple[Any, Any]:
        refused = error_of(lambda: _loss(ddp, tokens).backward())
        if how == "learnt":
            [p.grad.norm() for p in ddp.parameters() if p.grad is not None]
        return refused, error_of(opt.step)

    for tokens in data[:2]:
        assert one_step(tokens) == (None, None)
        opt.zero_grad()
    if rank == 0:
        opt.param_groups[0]["lr"] = LR * 2
    before = values(ddp)
    refused, step = one_step(data[2])
    return {"refused": refused, "step": step, "unchanged": compare(before, values(ddp))}
