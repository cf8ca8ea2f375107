"""The rank side of tests/test_backward_errors.py: an optimizer step that raises inside
backward, and optimizer_in_backward called before DDP wraps the module."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS, FAILING_STEP = 5, 2


class Fail:
    """A step pre-hook that raises while ``on`` is set (on every rank at one step)."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.on:
            raise RuntimeError("injected step failure")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _train(ddp: DDP, opt: Any, rank: int) -> dict[str, Any]:
    fail = Fail()
    opt.register_step_pre_hook(fail)
    errors = []
    for step, x in enumerate(rank_batches(rank, STEPS)):
        fail.on = step == FAILING_STEP
        try:
            ddp(x).square().mean().backward()
            opt.step()
        except RuntimeError as error:
            errors.append((step, str(error)))
        opt.zero_grad()
        # a collective right after: hangs (or fails) if the ranks fell out of step
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    return {"errors": errors, "values": values(ddp.module)}


def step_errors(rank: int, world_size: int) -> dict[str, Any]:
    plain_ddp = DDP(_model(), bucket_cap_mb=0.001)
    plain = _train(plain_ddp, torch.optim.AdamW(plain_ddp.parameters(), lr=0.01), rank)
    out: dict[str, Any] = {"plain errors": plain["errors"]}
    setups = {
        "overlap_ddp backward": lambda ddp: overlapkit.overlap_ddp(
            ddp, torch.optim.AdamW, lr=0.01, step_thread="backward"),
        "overlap_ddp comm": lambda ddp: overlapkit.overlap_ddp(
            ddp, torch.optim.AdamW, lr=0.01, step_thread="comm"),
        "optimizer_in_backward ddp": lambda ddp: overlapkit.optimizer_in_backward(
            ddp, torch.optim.AdamW, lr=0.01),
    }
    for name, make in setups.items():
        ddp = DDP(_model(), bucket_cap_mb=0.001)
        ours = _train(ddp, make(ddp), rank)
        out[name] = {"errors": ours["errors"], "same as plain": compare(plain["values"],
                                                                       ours["values"])}
    # plain module (no DDP): the error reaches the caller too, the module is intact
    module = _model()
    opt = overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=0.01)
    fail = Fail()
    opt.register_step_pre_hook(fail)
    before = values(module)
    fail.on = True
    error = error_of(lambda: module(torch.ones(2, 16)).square().mean().backward())
    out["plain module"] = {"error": error, "unchanged": compare(before, values(module))}
    return out


def wrapped_after(rank: int, world_size: int) -> dict[str, Any]:
    """optimizer_in_backward(model), then DDP(model): refused at the first forward,
    on every rank, before anything is stepped."""
    model = _model()
    overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    ddp = DDP(model)
    before = values(model)
    error = error_of(lambda: ddp(rank_batches(rank, 1)[0]).square().mean().backward())
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    return {"error": error, "unchanged": compare(before, values(model))}
