"""The rank side of tests/test_grad_scaler.py."""

from __future__ import annotations

from typing import Any

import torch
from helpers import error_of, rank_batches
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)))
        opt = getattr(overlapkit, technique)(ddp, torch.optim.SGD, lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(ddp(rank_batches(rank, 1)[0]).square().mean()).backward()
        out[technique] = error_of(lambda opt=opt, scaler=scaler: scaler.step(opt))
        # the refusal leaves no GradScaler attributes behind: a plain step works
        out[f"{technique} plain step after"] = error_of(opt.step)
        # scaler.unscale_(opt), the first call of torch's clipping AMP loop, is refused
        # too, before it touches a gradient
        ddp.zero_grad()
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(ddp(rank_batches(rank, 1)[0]).square().mean()).backward()
        grads = [None if p.grad is None else p.grad.clone() for p in ddp.parameters()]
        out[f"{technique} unscale_"] = error_of(lambda opt=opt, scaler=scaler:
                                                scaler.unscale_(opt))
        out[f"{technique} unscale_ left grads"] = all(
            (g is None and p.grad is None) or (g is not None and torch.equal(g, p.grad))
            for g, p in zip(grads, ddp.parameters(), strict=True))
        opt.release()
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        _adopted(rank, technique, out)
        _sharded_scaler(rank, technique, out)
    return out


def _sharded_scaler(rank: int, technique: str, out: dict[str, Any]) -> None:
    """FSDP's ShardedGradScaler (its own unscale_) on the overlapped optimizer, with
    grad_scaler= and without: before, its unscale_ was not seen (the kept gradients
    unscaled in place under overlap_ddp, silently)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    for given in (False, True):
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)))
        scaler = ShardedGradScaler("cpu", init_scale=1024.0)
        opt = getattr(overlapkit, technique)(
            ddp, torch.optim.SGD, lr=0.1, **({"grad_scaler": scaler} if given else {}))
        scaler.scale(ddp(rank_batches(rank, 1)[0]).square().mean()).backward()
        grads = [None if p.grad is None else p.grad.clone() for p in ddp.parameters()]
        key = f"{technique} ShardedGradScaler unscale_ {'with' if given else 'without'}"
        out[key] = error_of(lambda scaler=scaler, opt=opt: scaler.unscale_(opt))
        out[f"{key} unchanged"] = all(
            (g is None and p.grad is None) or (g is not None and torch.equal(g, p.grad))
            for g, p in zip(grads, ddp.parameters(), strict=True))
        opt.release()


def _adopted(rank: int, technique: str, out: dict[str, Any]) -> None:
    """The scaler driving the optimizer handed in (the adopted one, a kept reference):
    with and without grad_scaler=, step and unscale_; refused before it touches a
    gradient (before: torch's bare AssertionError under optimizer_in_backward; under
    overlap_ddp the kept gradients unscaled in place, then refused as a plain step)."""
    for given in (False, True):
        for call in ("step", "unscale_"):
            torch.manual_seed(0)
            ddp = DDP(nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)))
            inner = torch.optim.AdamW(ddp.parameters(), lr=0.1)
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            opt = getattr(overlapkit, technique)(
                ddp, inner, **({"grad_scaler": scaler} if given else {}))
            scaler.scale(ddp(rank_batches(rank, 1)[0]).square().mean()).backward()
            grads = [None if p.grad is None else p.grad.clone() for p in ddp.parameters()]
            params = [p.detach().clone() for p in ddp.parameters()]
            key = f"{technique} adopted {call} {'with' if given else 'without'} grad_scaler"
            out[key] = error_of(lambda scaler=scaler, inner=inner, call=call:
                                getattr(scaler, call)(inner))
            out[f"{key} unchanged"] = all(
                ((g is None and p.grad is None) or (g is not None and torch.equal(g, p.grad)))
                and torch.equal(q, p)
                for g, q, p in zip(grads, params, ddp.parameters(), strict=True))
            out[f"{key} attrs"] = sorted({"grad_scale", "found_inf"} & set(vars(inner)))
            opt.release()
