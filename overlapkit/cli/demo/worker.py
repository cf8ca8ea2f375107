"""What each rank of ``overlapkit demo`` runs: train one technique, or save/reload.

Functions here run inside the spawned (or torchrun-launched) ranks and return plain
data; the parent process builds the report. Each technique runs in fresh processes,
so the peak RSS a rank reports belongs to that technique alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from overlapkit.cli.demo.config import DemoConfig
from overlapkit.cli.demo.model import build_model, make_batches
from overlapkit.cli.memory import peak_rss_mib
from overlapkit.cli.progress import Progress

__all__ = ["OPTIMIZER_SETUPS", "reload_checkpoint", "save_checkpoint", "train_technique"]


def _plain(ddp: DDP, cfg: DemoConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ddp.parameters(), lr=cfg.lr)


def _overlap_ddp(ddp: DDP, cfg: DemoConfig) -> torch.optim.Optimizer:
    import overlapkit

    return overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=cfg.lr)


def _sharded(ddp: DDP, cfg: DemoConfig) -> torch.optim.Optimizer:
    import overlapkit

    return overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=cfg.lr,
                                  shard_optimizer_state=True)


def _optimizer_in_backward(ddp: DDP, cfg: DemoConfig) -> torch.optim.Optimizer:
    import overlapkit

    return overlapkit.optimizer_in_backward(ddp, torch.optim.AdamW, lr=cfg.lr)


def _post_local_sgd(ddp: DDP, cfg: DemoConfig) -> torch.optim.Optimizer:
    import overlapkit

    return overlapkit.post_local_sgd(
        ddp, torch.optim.AdamW(ddp.parameters(), lr=cfg.lr),
        period=cfg.period, warmup_steps=cfg.warmup_steps,
        # every rank its own subgroup: after warm-up, steps are truly local
        subgroup_size=1,
    )


#: technique -> how its optimizer is set up on a fresh DDP model
OPTIMIZER_SETUPS: dict[str, Callable[[DDP, DemoConfig], torch.optim.Optimizer]] = {
    "plain": _plain,
    "overlap_ddp": _overlap_ddp,
    "sharded": _sharded,
    "optimizer_in_backward": _optimizer_in_backward,
    "post_local_sgd": _post_local_sgd,
    "checkpoint": _plain,
}


def _train(rank: int, world_size: int, cfg: DemoConfig, technique: str,
           steps: int) -> tuple[DDP, torch.optim.Optimizer, list[float], list[float]]:
    ddp = DDP(build_model(cfg.size, cfg.seed), bucket_cap_mb=cfg.bucket_cap_mb)
    optimizer = OPTIMIZER_SETUPS[technique](ddp, cfg)
    batches = make_batches(cfg.size, steps, cfg.seed, rank)
    progress = Progress(steps, f"{technique:>22}", enabled=cfg.progress and rank == 0)
    times: list[float] = []
    losses: list[float] = []
    for x, y in batches:
        started = time.perf_counter()
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        # The mean over ranks, outside the timed step: the figure the progress bar,
        # the table and the plot all show.
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
        progress.update(1, f"loss {losses[-1]:.4f} (mean over ranks)")
    progress.close()
    return ddp, optimizer, times, losses


def train_technique(rank: int, world_size: int, cfg: DemoConfig, technique: str) -> dict[str, Any]:
    """Train ``technique`` for ``cfg.steps`` steps; rank 0 also returns the parameters."""
    ddp, _, times, losses = _train(rank, world_size, cfg, technique, cfg.steps)
    params = None
    if rank == 0:
        params = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).clone()
    return {"step_times": times, "losses": losses, "peak_rss_mib": peak_rss_mib(),
            "params": params}


def _snapshot(ddp: DDP, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    return {"model": model, "optimizer": optimizer.state_dict()}


def save_checkpoint(rank: int, world_size: int, cfg: DemoConfig, path: str) -> dict[str, Any]:
    """Train plain DDP, save a checkpoint to ``path``; rank 0 returns what was saved."""
    from overlapkit import checkpoint

    ddp, optimizer, times, losses = _train(rank, world_size, cfg, "checkpoint", cfg.steps)
    started = time.perf_counter()
    checkpoint.save(Path(path), ddp, optimizer)
    save_seconds = time.perf_counter() - started
    return {"saved": _snapshot(ddp, optimizer) if rank == 0 else None,
            "save_seconds": save_seconds, "step_times": times, "losses": losses,
            "peak_rss_mib": peak_rss_mib()}


def reload_checkpoint(rank: int, world_size: int, cfg: DemoConfig, path: str) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into a fresh model at this world size."""
    from overlapkit import checkpoint

    ddp = DDP(build_model(cfg.size, cfg.seed + 1), bucket_cap_mb=cfg.bucket_cap_mb)
    optimizer = _plain(ddp, cfg)
    started = time.perf_counter()
    checkpoint.load(Path(path), ddp, optimizer)
    load_seconds = time.perf_counter() - started
    return {"loaded": _snapshot(ddp, optimizer) if rank == 0 else None,
            "load_seconds": load_seconds, "peak_rss_mib": peak_rss_mib()}
