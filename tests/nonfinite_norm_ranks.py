"""The rank side of tests/test_nonfinite_norm.py: a loop that skips (or refuses) a step
on a non-finite gradient norm, plain and with ``clip_grad_norm=``, bitwise."""

from __future__ import annotations

import math
from typing import Any

import torch
from helpers import compare, rank_batches
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

#: the loops of a step with an inf gradient (the 2nd of 4)
LOOPS = ("isfinite skip", "error_if_nonfinite", "step anyway", "unclipped isfinite skip")


def train(technique: str | None, loop: str, rank: int, ddp: bool,
          **options: Any) -> list[torch.Tensor]:
    """4 steps of Adam clipping by norm 1.0 (inf: the norm read, nothing clipped), the
    2nd gradient inf; parameters and state after (``options``: the technique's).
    ``technique`` None: the plain loop."""
    max_norm = math.inf if loop.startswith("unclipped") else 1.0
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    if ddp:
        model = DDP(model)
    opt: Any = (torch.optim.Adam(model.parameters(), lr=0.05) if technique is None else
                getattr(overlapkit, technique)(model, torch.optim.Adam, lr=0.05,
                                               clip_grad_norm=max_norm, **options))
    for step, batch in enumerate(rank_batches(rank, 4)):
        loss = model(batch).square().mean() * (float("inf") if step == 1 else 1.0)
        loss.backward()
        try:
            norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), max_norm, error_if_nonfinite=loop == "error_if_nonfinite")
        except RuntimeError:  # torch's: raised before anything changed
            opt.zero_grad()
            continue
        if not loop.endswith("isfinite skip") or torch.isfinite(norm):
            opt.step()
        opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    if options.get("shard_optimizer_state"):
        return params  # its state_dict() is a consolidation, a collective of its own
    state = opt.state_dict()["state"]
    return params + [
        v for k in sorted(state) for v in state[k].values()]


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for loop in LOOPS:
        plain = train(None, loop, rank, ddp=True)
        for technique in ("overlap_ddp", "optimizer_in_backward"):
            out[f"{technique} {loop}"] = compare(
                plain, train(technique, loop, rank, ddp=True), equal_nan=True)
        out[f"sharded {loop}"] = compare(plain[:4], train(
            "overlap_ddp", loop, rank, ddp=True, shard_optimizer_state=True), equal_nan=True)
    return out
