"""The rank side of tests/test_optimizer_flags.py: on DDP (2 gloo ranks), ``overlap_ddp``
(plain and sharded) and ``optimizer_in_backward`` with ``differentiable=True`` or a
CPU ``capturable=True`` are refused at set-up, every rank, nothing changed; the
options torch's step takes on CPU (``capturable=True`` with ``fused=True``, a group's
own ``differentiable=True``) train as the plain loop, bitwise."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from helpers import error_of, rank_batches
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

#: (name, how the real optimizer is built from the DDP model)
REFUSED = {
    "differentiable": dict(differentiable=True),
    "capturable": dict(capturable=True),
}
HONOURED = {
    "capturable fused": dict(capturable=True, fused=True),
    "group differentiable": dict(group_differentiable=True),
}
TECHNIQUES = ("overlap_ddp", "sharded", "optimizer_in_backward")


def _optimizer(ddp: DDP, technique: str | None, flags: dict[str, Any]) -> Any:
    flags = dict(flags)
    params: Any = list(ddp.parameters())
    if flags.pop("group_differentiable", False):
        params = [{"params": params, "differentiable": True}]
    if technique is None:
        return torch.optim.AdamW(params, lr=1e-2, **flags)
    if technique == "optimizer_in_backward":
        return overlapkit.optimizer_in_backward(ddp, torch.optim.AdamW, lr=1e-2,
                                                params=params, **flags)
    return overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=1e-2, params=params,
                                  shard_optimizer_state=technique == "sharded", **flags)


def _trained(rank: int, technique: str | None, flags: dict[str, Any]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)),
              bucket_cap_mb=0.001)
    opt = _optimizer(ddp, technique, flags)
    for batch in rank_batches(rank, 3):
        ddp(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ddp.parameters()]


def run(rank: int, world_size: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for technique in TECHNIQUES:
        for name, flags in REFUSED.items():
            torch.manual_seed(0)
            ddp = DDP(nn.Linear(16, 4))
            before = [p.detach().clone() for p in ddp.parameters()]
            error = error_of(lambda: _optimizer(ddp, technique, flags))  # noqa: B023
            unchanged = all(torch.equal(a, b) and p.grad is None for a, b, p in zip(
                before, ddp.parameters(), ddp.parameters(), strict=True))
            found[f"{technique} {name}"] = (error, unchanged)
        for name, flags in HONOURED.items():
            plain = _trained(rank, None, flags)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                stepped = _trained(rank, technique, flags)
            found[f"{technique} {name}"] = all(
                torch.equal(a, b) for a, b in zip(plain, stepped, strict=True))
    return found
