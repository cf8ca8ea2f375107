"""The rank side of tests/test_sharded_checkpoint.py: sharded optimizer state saved from
2 ranks and loaded at 1, 2 and 3, into a sharded optimizer and a plain one (and from a
plain one), with ``overlapkit.checkpoint``; the whole state dict gathered for
``torch.save``; a rank's own share at the same world size only."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from helpers import compare, error_of, values
from sharded_state_ranks import (
    AllOnLastRank,
    _loss,
    batches,
    build,
    build_reference,
    compare_state_dicts,
    param_groups,
)

import overlapkit
from overlapkit import checkpoint

BEFORE, AFTER = 3, 3  # steps before the save, and after it (or after the load)
LR = 0.01
#: checkpoint sources, saved by :func:`save_run`: the optimizer that saved each
SOURCES = {"sharded": True, "plain": False, "sharded, rank 0 owning nothing": "empty"}
#: what each is loaded into by :func:`load_run`
TARGETS = {"sharded": True, "plain": False, "sharded, rank 0 owning nothing": "empty"}


def make_optimizer(ddp: Any, kind: Any) -> Any:
    """AdamW on two param groups: plain (``False``), sharded (``True``), or sharded
    with every parameter on the last rank (``"empty"``)."""
    if kind is False:
        return torch.optim.AdamW(param_groups(ddp, True), lr=LR)
    policy = AllOnLastRank() if kind == "empty" else True
    return overlapkit.overlap_ddp(ddp, torch.optim.AdamW, params=param_groups(ddp, True),
                                  lr=LR, shard_optimizer_state=policy)


def train(ddp: Any, opt: Any, data: list[torch.Tensor]) -> None:
    for tokens in data:
        _loss(ddp, tokens).backward()
        opt.step()
        opt.zero_grad()


def whole_state(opt: Any, rank: int) -> dict[str, Any] | None:
    """A copy of the whole optimizer state dict on rank 0 (gathered when sharded), None
    elsewhere (``state_dict()`` holds the live tensors, which later steps change)."""
    if isinstance(opt, overlapkit.ShardedOverlapOptimizer):
        opt.consolidate_state_dict(to=0)
    return copy.deepcopy(opt.state_dict()) if rank == 0 else None


def save_run(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Train ``BEFORE`` steps with each source optimizer and save a checkpoint of each;
    the sharded one also as a gathered state dict (``torch.save``) and as one file per
    rank (its share); then train the sharded one on: the uninterrupted run."""
    root = Path(directory)
    data = batches(rank, BEFORE + AFTER)
    out: dict[str, Any] = {}
    for name, kind in SOURCES.items():
        ddp = build() if kind is not False else build_reference()
        opt = make_optimizer(ddp, kind)
        train(ddp, opt, data[:BEFORE])
        checkpoint.save(root / name, ddp, opt)
        out[name] = {"values": values(ddp), "state": whole_state(opt, rank)}
        if kind is True:
            if rank == 0:
                torch.save({"model": ddp.module.state_dict(), "optimizer": out[name]["state"]},
                           root / "whole.pt")
            torch.save(opt.local_state_dict(), root / f"share-{rank}.pt")
            train(ddp, opt, data[BEFORE:])
            out["uninterrupted"] = values(ddp)
            out["saved share"] = {id(p) for p in opt.optimizer.state} <= opt.local_state_params()
    return out


def load_run(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Load each checkpoint into each target at this world size; what was loaded, what
    each rank holds, and the parameters after ``AFTER`` more steps."""
    root = Path(directory)
    data = batches(rank, BEFORE + AFTER)[BEFORE:]
    out: dict[str, Any] = {}
    for source in SOURCES:
        for target, kind in TARGETS.items():
            ddp = build(seed=1) if kind is not False else build_reference(seed=1)
            opt = make_optimizer(ddp, kind)
            checkpoint.load(root / source, ddp, opt)
            loaded = {"values": values(ddp), "state": whole_state(opt, rank)}
            share = (opt.local_state_params() if kind is not False
                     else {id(p) for p in opt.state})
            held = {id(p) for p in (opt.optimizer.state if kind is not False else opt.state)}
            train(ddp, opt, data)
            out[f"{source} -> {target}"] = {
                "loaded": loaded, "held only its share": held <= share,
                "after": values(ddp)}
    # the gathered state dict, saved with torch.save, into a sharded optimizer
    ddp = build(seed=1)
    opt = make_optimizer(ddp, True)
    whole = torch.load(root / "whole.pt", weights_only=True)
    ddp.module.load_state_dict(whole["model"])
    opt.load_state_dict(whole["optimizer"])
    out["whole.pt -> sharded"] = {"loaded": {"values": values(ddp),
                                             "state": whole_state(opt, rank)}}
    # a rank's own share: the same world size only
    ddp = build(seed=1)
    opt = make_optimizer(ddp, True)
    share_file = root / f"share-{rank}.pt"
    share = torch.load(share_file, weights_only=True) if share_file.exists() else None
    if share is None:  # a rank the saving run did not have: another rank's file
        share = torch.load(root / "share-0.pt", weights_only=True)
    error = error_of(lambda: opt.load_state_dict(share))
    out["share"] = {"error": error, "still fresh": not opt.optimizer.state}
    if error is None:
        checkpoint.load(root / "sharded", ddp, None)  # the parameters
        out["share"]["loaded"] = {"values": values(ddp), "state": whole_state(opt, rank)}
    return out


def compare_loaded(saved: dict[str, Any], loaded: dict[str, Any], rank: int) -> dict[str, Any]:
    """Parameters and (rank 0) the whole optimizer state, bitwise."""
    return {"values": compare(saved["values"], loaded["values"]),
            "state": (compare_state_dicts(saved["state"], loaded["state"]) if rank == 0
                      else compare([], []))}
