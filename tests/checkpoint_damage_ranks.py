"""The rank side of tests/test_checkpoint_damage.py: a failed load changes nothing.

Two ranks save a DDP model + AdamW; rank 0 damages a copy of the checkpoint in one way
at a time; both ranks then try to load it into a model and optimizer that hold other
values (and into a fresh optimizer), and report what changed."""

from __future__ import annotations

import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import compare, error_of, named_values, rank_batches
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.checkpoint.integrity import MANIFEST_FILE


class Payload:
    """Unpickling it would create a directory: the stand-in for arbitrary code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (self.marker,)


def _trained(seed: int, steps: int, rank: int) -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for x in rank_batches(rank, steps, seed=seed):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _largest_data_file(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)


def _damage(kind: str, source: Path, target: Path, marker: str, rank: int) -> None:
    if kind == "malicious entry":  # written by plain DCP: no file list to catch it
        model, opt = _trained(0, 2, rank)
        model_sd, optim_sd = get_state_dict(model, opt)
        optim_sd["param_groups"][0]["weight_decay"] = Payload(marker)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=target)
        return
    if rank == 0:
        shutil.copytree(source, target)
        data = _largest_data_file(target)
        raw = bytearray(data.read_bytes())
        if kind == "truncated":
            data.write_bytes(raw[: len(raw) // 2])
        elif kind == "zeroed header":
            raw[:512] = bytes(512)
            data.write_bytes(raw)
        elif kind == "random bytes":
            middle = len(raw) // 2
            raw[middle:middle + 64] = os.urandom(64)
            data.write_bytes(raw)
        elif kind == "truncated, no file list":
            (target / MANIFEST_FILE).unlink()
            data.write_bytes(raw[: len(raw) // 2])
    dist.barrier()


KINDS = ["truncated", "zeroed header", "random bytes", "malicious entry",
         "truncated, no file list"]


def _values_and_state(model: DDP, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {f"state.{i}.{k}": v.clone() for i, s in enumerate(opt.state.values())
             for k, v in s.items()}
    return {**named_values(model.module), **state}


def run(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    root = Path(directory)
    model, opt = _trained(0, 2, rank)
    overlapkit.checkpoint.save(root / "good", model, opt)
    out: dict[str, Any] = {}
    for kind in KINDS:
        target = root / kind.replace(" ", "-").replace(",", "")
        marker = str(root / f"ran-{rank}")
        _damage(kind, root / "good", target, marker, rank)
        other, other_opt = _trained(5, 1, rank)  # other values, and Adam state
        before = _values_and_state(other, other_opt)
        error = error_of(partial(overlapkit.checkpoint.load, target, other, other_opt))
        after = _values_and_state(other, other_opt)
        fresh = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        fresh_error = error_of(partial(overlapkit.checkpoint.load, target, fresh, fresh_opt))
        out[kind] = {"error": error, "unchanged": compare(before, after),
                     "fresh error": fresh_error, "fresh has no state": len(fresh_opt.state) == 0,
                     "code ran": os.path.exists(marker)}
        dist.barrier()
    # the good checkpoint still loads, exactly
    other, other_opt = _trained(5, 1, rank)
    overlapkit.checkpoint.load(root / "good", other, other_opt)
    out["good loads"] = compare(named_values(model.module), named_values(other.module))
    return out
