"""The rank side of tests/test_comm_hook_guard.py: DDP's comm-hook registrations on a
model overlapkit set up (refused by name, nothing changed), after ``release()``, on a
deep copy and on another DDP model (torch's own)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from helpers import error_of, rank_batches, values
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

#: name -> the registration it calls on a DDP model
CALLS: dict[str, Any] = {
    "register_comm_hook": lambda m: m.register_comm_hook(None, default_hooks.fp16_compress_hook),
    "_register_builtin_comm_hook": lambda m: m._register_builtin_comm_hook(
        dist.BuiltinCommHookType.FP16_COMPRESS),
    "_register_fused_optim": lambda m: m._register_fused_optim(torch.optim.SGD, lr=0.1),
}


def _model() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)))


def _train(model: DDP, opt: Any, rank: int) -> list[torch.Tensor]:
    for batch in rank_batches(rank, 3):
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return values(model)


def run(rank: int, world_size: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    plain_model = _model()
    plain = _train(plain_model, torch.optim.SGD(plain_model.parameters(), lr=0.1), rank)
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        for name, call in CALLS.items():
            model = _model()
            opt = getattr(overlapkit, technique)(model, torch.optim.SGD, lr=0.1)
            refused = error_of(lambda m=model, c=call: c(m))
            trained = _train(model, opt, rank)
            opt.release()
            out[technique, name] = {
                "refused": refused,
                "then bitwise plain": all(torch.equal(a, b) for a, b in
                                          zip(plain, trained, strict=True)),
                "after release": error_of(lambda m=model, c=call: c(m)),
                "on a copy": error_of(lambda m=model, c=call: c(copy.deepcopy(m))),
                "on another model": error_of(lambda c=call: c(_model()))}
    return out
