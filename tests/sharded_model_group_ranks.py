"""The rank side of tests/test_sharded_model_group.py: a sharded optimizer over a DDP
model built on a subgroup, after ``dist.destroy_process_group(subgroup)``, against plain
DDP + AdamW on a live subgroup of the same ranks, on 2 gloo ranks.

Each function returns the errors raised (:func:`~helpers.error_of`) and what differed
(:class:`~helpers.Comparison`).
"""

from __future__ import annotations

import copy
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, values
from sharded_state_ranks import LR, Net, _loss, batches
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

#: what a rank built on the destroyed subgroup, kept until the rank exits: freed when
#: the function returns, a DDP model's reducer over a destroyed gloo group could hang in
#: its destructor (seen once in a few runs), and the rank never reported
_KEPT: list[Any] = []


def _on(group: Any) -> DDP:
    torch.manual_seed(0)
    return DDP(Net(), bucket_cap_mb=0.001, process_group=group)


def _train(ddp: DDP, opt: Any, data: list[torch.Tensor]) -> None:
    for tokens in data:
        _loss(ddp, tokens).backward()
        opt.step()
        opt.zero_grad()


def subgroup_destroyed(rank: int, world_size: int, directory: str,
                       technique: str = "sharded") -> dict[str, Any]:
    """Train 2 steps, save a checkpoint, destroy the DDP model's subgroup; then
    ``overlapkit.checkpoint.save`` and ``load`` (and, sharded, ``consolidate_state_dict()``):
    each refused, nothing gathered, written or loaded; training goes on bitwise plain
    DDP. ``technique``: ``"sharded"`` (``overlap/sharded/model_group.py``), ``"plain"``
    (torch's AdamW) or ``"overlap_ddp"`` unsharded (``checkpoint/arguments.py``)."""
    timeout = datetime.timedelta(seconds=30)
    sub = dist.new_group(list(range(world_size)), backend="gloo", timeout=timeout)
    live = dist.new_group(list(range(world_size)), backend="gloo", timeout=timeout)
    reference, ddp = _on(live), _on(sub)
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    opt = (torch.optim.AdamW(ddp.parameters(), lr=LR) if technique == "plain"
           else overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR,
                                       shard_optimizer_state=technique == "sharded"))
    data = batches(rank, 4)
    _train(reference, plain, data[:2])
    _train(ddp, opt, data[:2])
    saved = os.path.join(directory, "before")
    overlapkit.checkpoint.save(saved, ddp, opt)
    dist.destroy_process_group(sub)
    sharded = technique == "sharded"
    kept = copy.deepcopy(opt.local_state_dict()) if sharded else None
    params = [p.detach().clone() for p in ddp.parameters()]
    out: dict[str, Any] = {}
    if sharded:
        out["consolidate"] = error_of(lambda: opt.consolidate_state_dict(0))
    out["save"] = error_of(lambda: overlapkit.checkpoint.save(
        os.path.join(directory, "after"), ddp, opt))
    out["written"] = os.path.exists(os.path.join(directory, "after"))
    opt.param_groups[0]["lr"] = LR * 3  # a load would put LR back
    out["load"] = error_of(lambda: overlapkit.checkpoint.load(saved, ddp, opt))
    out["load left lr"] = opt.param_groups[0]["lr"] == LR * 3
    opt.param_groups[0]["lr"] = LR
    out["unchanged"] = compare(params, [p.detach() for p in ddp.parameters()])
    if kept is not None:
        now = opt.local_state_dict()
        out["state unchanged"] = compare(
            [v for e in kept["sharded_state"].values() for v in e.values()],
            [v for e in now["sharded_state"].values() for v in e.values()])
    _train(reference, plain, data[2:])
    _train(ddp, opt, data[2:])
    out["values"] = compare(values(reference), values(ddp))
    _KEPT.extend((sub, ddp, opt))
    return out


def one_rank_subgroup_destroyed(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """The same at one rank: the gathering and ``overlapkit.checkpoint.save`` look no
    group up there, and work as before."""
    sub = dist.new_group([0], backend="gloo")
    ddp = _on(sub)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR, shard_optimizer_state=True)
    _train(ddp, opt, batches(rank, 2))
    dist.destroy_process_group(sub)
    return {"consolidate": error_of(lambda: (opt.consolidate_state_dict(0), opt.state_dict())),
            "save": error_of(lambda: overlapkit.checkpoint.save(
                os.path.join(directory, "one"), ddp, opt))}
