"""The rank side of tests/test_defer_steps.py: backwards inside the facade's
``defer_steps()`` reduce and step nothing, and the next ``step()`` is the plain step
(2 gloo ranks, DDP)."""

from __future__ import annotations

from typing import Any

import torch
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

SETUPS = {
    "overlap_ddp": {},
    "overlap_ddp clip": {"clip_grad_norm": 0.05},
    "optimizer_in_backward": {},
    "optimizer_in_backward clip": {"clip_grad_norm": 0.05},
}


def _ddp() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)),
               bucket_cap_mb=0.001)


def _train(rank: int, name: str) -> dict[str, Any]:
    """Three steps: the first with its backward deferred, the others stepping in
    backward."""
    ddp = _ddp()
    opt = getattr(overlapkit, name.split()[0])(ddp, torch.optim.AdamW, lr=0.01,
                                               **SETUPS[name])
    out: dict[str, Any] = {}
    for step, x in enumerate(rank_batches(rank, 3)):
        if step == 0:
            before = values(ddp.module)
            with opt.defer_steps():
                ddp(x).square().mean().backward()
            out["nothing stepped"] = compare(before, values(ddp.module))
            out["gradients kept"] = all(p.grad is not None for p in ddp.parameters())
            opt.step()
        else:
            ddp(x).square().mean().backward()
            opt.step()
        opt.zero_grad()
    out["values"] = values(ddp.module)
    return out


def _plain(rank: int, clip: float | None) -> list[torch.Tensor]:
    ddp = _ddp()
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    for x in rank_batches(rank, 3):
        ddp(x).square().mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return values(ddp.module)


def _gated(rank: int) -> dict[str, Any]:
    """A gate refusing the second backward of a deferred window: raised at its end,
    nothing stepped by either."""
    ddp = _ddp()
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=0.01)
    seen: list[int] = []

    def gate() -> overlapkit.OverlapkitError | None:
        seen.append(1)
        return overlapkit.ConfigurationError("second") if len(seen) > 1 else None

    opt.gate_backwards(gate)
    before = values(ddp.module)
    x, y = rank_batches(rank, 2)
    with opt.defer_steps():
        ddp(x).square().mean().backward()
        error = error_of(lambda: ddp(y).square().mean().backward())
    return {"error": error, "asked": len(seen), "unchanged": compare(before, values(ddp.module))}


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, options in SETUPS.items():
        ours = _train(rank, name)
        ours["values"] = compare(_plain(rank, options.get("clip_grad_norm")), ours["values"])
        out[name] = ours
    out["gated"] = _gated(rank)
    return out
