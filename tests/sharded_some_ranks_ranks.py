"""The rank side of tests/test_sharded_gathering_some_ranks.py: ``consolidate_state_dict()``
or ``overlapkit.checkpoint.save`` called on rank 0 alone (the ``if rank == 0:`` save of a
loop ported from a plain optimizer), the other rank training on, at 2 gloo ranks, each
part on a process group of its own with an 8 s timeout (it leaves its collectives out of
step).

Each part returns what was raised on each rank (:func:`~helpers.error_of`), the seconds
it took, and whether anything changed (parameters, optimizer state).
"""

from __future__ import annotations

import datetime
import io
import time
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, values
from sharded_state_ranks import LR, Net, _loss, batches
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
import overlapkit.checkpoint

TIMEOUT = 8.0


def _trained(rank: int) -> tuple[Any, Any, list[torch.Tensor]]:
    """A sharded AdamW on a DDP model of a group of its own, past DDP's bucket rebuild
    (two steps: the second forward's rebuild is a collective of its own)."""
    dist.barrier()  # (the last part's rank 1 waits for its reduction's timeout)
    group = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT))
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=0.001, process_group=group)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR, shard_optimizer_state=True)
    data = batches(rank, 3)
    for tokens in data[:2]:
        _loss(ddp, tokens).backward()
        opt.step()
        opt.zero_grad()
    return ddp, opt, data


def _state(opt: Any) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v.clone() for i, p in enumerate(opt.param_groups[0]["params"])
            for k, v in opt.state[p].items()}


def _part(rank: int, saving: str, other: str, path: str) -> dict[str, Any]:
    """Rank 0 saves (``saving``: gathering the state, or ``overlapkit.checkpoint.save``),
    rank 1 does ``other`` (``step()`` alone, a backward, or the other way of saving)."""
    ddp, opt, data = _trained(rank)
    before, state = values(ddp), _state(opt)

    def gather() -> None:
        opt.consolidate_state_dict(to=0)
        torch.save(opt.state_dict(), io.BytesIO())

    def checkpoint() -> None:
        overlapkit.checkpoint.save(path, ddp, opt)

    def train_on() -> None:
        if other == "backward":
            _loss(ddp, data[2]).backward()
        opt.step()

    ways = {"gather": gather, "checkpoint": checkpoint}
    started = time.monotonic()
    error = error_of(ways[saving] if rank == 0 else ways.get(other, train_on))
    return {"error": error, "seconds": time.monotonic() - started,
            "unchanged": compare(before, values(ddp)) and compare(state, _state(opt))}


def some_ranks(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Each part on a new group: rank 0 gathers while rank 1 calls ``step()`` alone (no
    backward) or backward; rank 0 saves a checkpoint while rank 1 runs backward, or
    gathers."""
    return {"gather/step": _part(rank, "gather", "step", path),
            "gather/backward": _part(rank, "gather", "backward", path),
            "checkpoint/backward": _part(rank, "checkpoint", "backward", path),
            "checkpoint/gather": _part(rank, "checkpoint", "gather", path)}
