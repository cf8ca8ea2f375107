"""Checkpoint load benchmark: overlapkit's ``load`` against torch's DCP path.

A checkpoint of an FSDP2 model with AdamW state (>= 200 MiB; a few MiB with
``quick=True``) is saved once on ``save_world_size`` ranks, then loaded on
``world_size`` ranks, resharding, by two variants on the same files, interleaved over
``rounds`` rounds, each in freshly spawned ranks so peak RSS is the load's own:

``overlapkit``
    ``overlapkit.checkpoint.load(path, model, optimizer)``
``torch``
    ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``, as torch's docs show.

Each rank builds its model on the meta device and materialises only its shard, so
the baseline holds no full copy. Reported per variant: load time (slowest rank,
median over rounds), peak RSS above the baseline taken before the model is built
(largest rank, median), the local shard (model + optimizer state on the largest
rank), and their ratio; both variants must load identical values (checked). The
integrity check ``load`` runs first (already inside its load time) is also timed alone.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from overlapkit.cli.bench import goal
from overlapkit.cli.memory import peak_rss_mib
from overlapkit.distributed import run_distributed

__all__ = ["run_benchmark"]

VARIANTS = ("overlapkit", "torch")


def _model(layers: int, dim: int, *, meta: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta" if meta else "cpu"):
        model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    if meta:
        model.to_empty(device="cpu")
    return model


def _save(rank: int, world_size: int, path: str, layers: int, dim: int) -> None:
    from overlapkit import checkpoint

    for where, size in ((path, dim), (path + "-warmup", 16)):
        torch.manual_seed(0)
        model = _model(layers, size, meta=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, size)).sum().backward()
        opt.step()
        checkpoint.save(where, model, opt)


def _local_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, float]:
    total, checksum = 0, 0.0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
        checksum += float(local.detach().double().sum())
        for value in opt.state[p].values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                v = value.to_local() if hasattr(value, "to_local") else value
                total += v.numel() * v.element_size()
                checksum += float(v.detach().double().sum())
    return total, checksum


def _load(rank: int, world_size: int, path: str, variant: str, layers: int, dim: int
          ) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from overlapkit import checkpoint

    def load(where: str, size: int) -> tuple[nn.Module, torch.optim.Optimizer, float]:
        model = _model(layers, size, meta=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dist.barrier()
        start = time.perf_counter()
        if variant == "overlapkit":
            checkpoint.load(where, model, opt)
        else:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=where)
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        return model, opt, time.perf_counter() - start

    # A tiny checkpoint first, so lazy imports and first-use allocations are in the
    # baseline rather than counted as the load's memory.
    load(path + "-warmup", 16)  # the warm-up model is dropped right away
    dist.barrier()
    baseline = peak_rss_mib()
    model, opt, seconds = load(path, dim)
    local, checksum = _local_bytes(model, opt)
    return {"load_s": seconds, "peak_rss_above_baseline_mib": peak_rss_mib() - baseline,
            "local_shard_mib": local / 2**20, "checksum": checksum}


def _time_the_check(path: Path, rounds: int) -> float:
    """Median seconds of the integrity check ``load`` runs first (rank 0 reads every
    file once for its size and CRC-32), on the saved checkpoint, page cache warm as in
    the loads measured."""
    from overlapkit.checkpoint.integrity import verify_files

    times = []
    for _ in range(max(1, rounds)):
        start = time.perf_counter()
        verify_files(path)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ratio(ours: float, theirs: float) -> float | None:
    """``ours / theirs``, or ``None`` where ``theirs`` measured nothing (a peak that
    stayed under the baseline's high-water mark)."""
    return round(ours / theirs, 3) if theirs > 0 else None


def run_benchmark(
    *,
    rounds: int = 5,
    world_size: int = 4,
    quick: bool = False,
    save_world_size: int | None = None,
    layers: int | None = None,
    dim: int | None = None,
    directory: str | None = None,
) -> dict[str, Any]:
    """Save once at ``save_world_size`` (default ``world_size // 2``), then load at
    ``world_size`` with each variant, ``rounds`` times interleaved.

    :return: ``{"benchmark", "command", "variants": {variant: {metric: median}},
        "ratios", "notes"}``, JSON-serialisable.
    """
    if quick:
        rounds = min(rounds, 2)
    save_ws = save_world_size or max(1, world_size // 2)
    layers = layers or (4 if quick else 17)
    dim = dim or (256 if quick else 1024)
    root = Path(tempfile.mkdtemp(prefix="overlapkit-bench-ckpt-", dir=directory))
    path = str(root / "ckpt")
    try:
        run_distributed(_save, save_ws, args=(path, layers, dim), timeout=600)
        size_mib = sum(f.stat().st_size for f in Path(path).iterdir()) / 2**20
        check_s = _time_the_check(Path(path), rounds)
        per_round: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                per_round[variant].append(run_distributed(
                    _load, world_size, args=(path, variant, layers, dim), timeout=600))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    checksums = {v: [rank["checksum"] for rank in per_round[v][0]] for v in VARIANTS}
    if checksums["overlapkit"] != checksums["torch"]:
        raise AssertionError(f"the variants loaded different values: {checksums}")
    variants: dict[str, dict[str, float]] = {}
    for v in VARIANTS:
        runs = per_round[v]
        load = statistics.median(max(rank["load_s"] for rank in run) for run in runs)
        peak = statistics.median(max(rank["peak_rss_above_baseline_mib"] for rank in run)
                                 for run in runs)
        local = max(rank["local_shard_mib"] for rank in runs[0])
        variants[v] = {"load_s": round(load, 4), "peak_rss_above_baseline_mib": round(peak, 1),
                       "local_shard_mib": round(local, 1),
                       "peak_over_local_shard": round(peak / local, 3)}
    return {
        "benchmark": "checkpoint",
        "command": f"python benchmarks/checkpoint.py --rounds {rounds} --world-size "
                   f"{world_size}" + (" --quick" if quick else ""),
        "checkpoint_mib": round(size_mib, 1),
        "resharding": f"{save_ws} -> {world_size} ranks",
        # part of overlapkit's load_s: rank 0 re-reads every file for its size and CRC-32
        "integrity_check_s": round(check_s, 4),
        "variants": variants,
        "ratios": {
            "load_time_overlapkit_over_torch": _ratio(
                variants["overlapkit"]["load_s"], variants["torch"]["load_s"]),
            "integrity_check_share_of_load": _ratio(check_s, variants["overlapkit"]["load_s"]),
            "peak_rss_overlapkit_over_torch": _ratio(
                variants["overlapkit"]["peak_rss_above_baseline_mib"],
                variants["torch"]["peak_rss_above_baseline_mib"]),
        },
        "goals": [
            goal("load time, overlapkit / torch", _ratio(
                variants["overlapkit"]["load_s"], variants["torch"]["load_s"]), at_most=1.0,
                 judged=not quick),
            goal("overlapkit's peak RSS above baseline / local shard",
                 variants["overlapkit"]["peak_over_local_shard"], at_most=1.2,
                 judged=not quick),
        ],
        "notes": "FSDP2 model of bias-free Linear layers with AdamW state, saved on "
                 f"{save_ws} ranks, loaded on {world_size} gloo ranks (1 thread each); "
                 "medians over interleaved rounds, fresh processes per load; peak RSS is "
                 "VmHWM above the peak before the model is built; both variants load "
                 "identical values (checked).",
    }
