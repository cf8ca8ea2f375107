"""The rank side of tests/test_checkpoint_agreement.py: when one rank alone refuses a save
or load, every rank raises at once (no rank waits in a collective for the one that
stopped), and nothing changes on any rank."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, named_values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from overlapkit import checkpoint
from overlapkit.checkpoint.integrity import MANIFEST_FILE

#: what goes wrong, and on which rank
CASES = ("missing path on rank 1", "other optimizer on rank 1", "other shapes on rank 1",
         "bad save argument on rank 1", "damaged file only rank 0 checksums")


def _trained(rank: int, width: int = 8, ddp: bool = True
             ) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))
    if ddp:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4) + rank).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    snapshot = dict(named_values(model))
    for index, state in enumerate(opt.state.values()):
        for key, value in state.items():
            snapshot[f"state {index} {key}"] = value.detach().clone()
    return snapshot


def _case(rank: int, root: Path, case: str) -> dict[str, Any]:
    # DDP checks that every rank's model has the same shapes: that case is plain modules
    shapes = case == "other shapes on rank 1"
    model, opt = _trained(rank, width=16 if shapes and rank == 1 else 8, ddp=not shapes)
    path = root / "ck"
    if case == "damaged file only rank 0 checksums" and rank == 0:
        # the ranks share the checksums, the largest file first to rank 0: only rank 0
        # reads this one, so only rank 0 finds the damage
        largest = max(json.loads((path / MANIFEST_FILE).read_text())["files"].items(),
                      key=lambda item: item[1]["size"])[0]
        data = bytearray((path / largest).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (path / largest).write_bytes(bytes(data))
    if case == "other optimizer on rank 1" and rank == 1:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = _snapshot(model, opt)
    dist.barrier()
    files_before = sorted(p.name for p in root.rglob("*"))
    started = time.monotonic()
    if case == "bad save argument on rank 1":
        optimizer: Any = opt if rank == 0 else "adam"
        error = error_of(lambda: checkpoint.save(root / "other", model, optimizer))
    else:
        target = root / "not-there" if case.startswith("missing") and rank == 1 else path
        error = error_of(lambda: checkpoint.load(target, model, opt))
    return {"error": error, "seconds": time.monotonic() - started,
            "unchanged": compare(before, _snapshot(model, opt)),
            "files unchanged": files_before == sorted(p.name for p in root.rglob("*"))}


def run(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Each case in turn (the damaged file last: it stays damaged)."""
    root = Path(directory)
    model, opt = _trained(rank)
    checkpoint.save(root / "ck", model, opt)
    results = {}
    for case in CASES:
        results[case] = _case(rank, root, case)
        dist.barrier()
    return results
