"""The rank side of tests/test_backward_errors.py: an optimizer step that raises inside
backward, and optimizer_in_backward called before DDP wraps the module."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS, FAILING_STEP = 5, 2


class Fail:
    """A step failure injected while ``on`` is set (on every rank at one step): a step
    pre-hook of a plain optimizer; for an overlapkit one, the real optimizer's ``step``
    patched on the instance, which each partial step inside backward calls (a step
    pre-hook would have the steps taken at ``step()``, in the plain order)."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.on:
            raise RuntimeError("injected step failure")

    def install(self, opt: Any) -> None:
        real = getattr(opt, "optimizer", None)
        if real is None:
            opt.register_step_pre_hook(self)
            return
        step = real.step

        def failing_step(*args: Any, **kwargs: Any) -> Any:
            self(real, args, kwargs)
            return step(*args, **kwargs)

        failing_step.overlapkit_per_part = True  # type: ignore[attr-defined]
        real.step = failing_step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _train(ddp: DDP, opt: Any, rank: int, checkpoint: str) -> dict[str, Any]:
    fail = Fail()
    fail.install(opt)
    errors, saved, grads = [], None, []
    for step, x in enumerate(rank_batches(rank, STEPS)):
        fail.on = step == FAILING_STEP
        try:
            ddp(x).square().mean().backward()
            opt.step()
        except RuntimeError as error:
            errors.append((step, str(error)))
        if step == FAILING_STEP:  # the reduced gradients, as plain DDP leaves them
            grads = [torch.full_like(p, float("nan")) if p.grad is None else p.grad.clone()
                     for p in ddp.parameters()]
        opt.zero_grad()
        # a collective right after: hangs (or fails) if the ranks fell out of step
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        if step == FAILING_STEP:  # and a checkpoint save (collectives of its own)
            saved = error_of(lambda: overlapkit.checkpoint.save(checkpoint, ddp, opt))
    return {"errors": errors, "values": values(ddp.module), "save error": saved,
            "grads": grads}


def step_errors(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    plain_ddp = DDP(_model(), bucket_cap_mb=0.001)
    plain = _train(plain_ddp, torch.optim.AdamW(plain_ddp.parameters(), lr=0.01), rank,
                   os.path.join(directory, "plain"))
    plain_fp16_ddp = DDP(_model(), bucket_cap_mb=0.001)
    plain_fp16_ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    plain_fp16 = _train(plain_fp16_ddp, torch.optim.AdamW(plain_fp16_ddp.parameters(),
                                                          lr=0.01),
                        rank, os.path.join(directory, "plain-fp16"))
    out: dict[str, Any] = {"plain errors": plain["errors"],
                           "plain save error": plain["save error"]}
    setups = {
        "overlap_ddp backward": lambda ddp: overlapkit.overlap_ddp(
            ddp, torch.optim.AdamW, lr=0.01, step_thread="backward"),
        "overlap_ddp comm": lambda ddp: overlapkit.overlap_ddp(
            ddp, torch.optim.AdamW, lr=0.01, step_thread="comm"),
        "optimizer_in_backward ddp": lambda ddp: overlapkit.optimizer_in_backward(
            ddp, torch.optim.AdamW, lr=0.01),
        "overlap_ddp fp16_compress": lambda ddp: overlapkit.overlap_ddp(
            ddp, torch.optim.AdamW, lr=0.01, comm_hook="fp16_compress"),
    }
    for name, make in setups.items():
        ddp = DDP(_model(), bucket_cap_mb=0.001)
        ours = _train(ddp, make(ddp), rank, os.path.join(directory, name.replace(" ", "-")))
        reference = plain_fp16 if "fp16" in name else plain
        out[name] = {"errors": ours["errors"], "save error": ours["save error"],
                     "same as plain": compare(reference["values"], ours["values"]),
                     "same gradients": compare(reference["grads"], ours["grads"])}
    # plain module (no DDP): the error reaches the caller too, the module is intact
    module = _model()
    opt = overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=0.01)
    fail = Fail()
    fail.install(opt)
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


def sharded_after(rank: int, world_size: int) -> dict[str, Any]:
    """optimizer_in_backward(model), then fully_shard(model): its parameters are new
    objects, the step hooks on the old ones would never run; refused at the first
    forward, on every rank, before anything is stepped."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    fully_shard(model)
    before = values(model)
    error = error_of(lambda: model(rank_batches(rank, 1)[0]).square().mean().backward())
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    return {"error": error, "unchanged": compare(before, values(model))}
