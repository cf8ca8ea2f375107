"""What laying a resumed DDP model's buckets out as the saved run did costs at load.

    python benchmarks/resume_layout.py [--rounds 3] [--world-size 2] [--layers 12] [--json]

Saves a checkpoint of ``--layers`` x ``Linear(2048, 2048)`` (12: 50 M parameters)
trained two steps with ``overlap_ddp`` and AdamW, then, in each round, builds a fresh
model and times ``overlapkit.checkpoint.load`` (the replay of the bucket layout
included: ``overlapkit.checkpoint.ddp_buckets``), and on another fresh model the replay
alone (``replay_layout``), and one training step for scale. gloo on CPU, one thread per
rank; medians over rounds of the slowest rank. The figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.checkpoint.ddp_buckets import replay_layout
from overlapkit.distributed import run_distributed


def _fresh(layers: int) -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)]))
    return model, overlapkit.overlap_ddp(model, torch.optim.AdamW, lr=1e-3)


def _step(model: DDP, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 2048)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _timed(action: Any, *args: Any) -> float:
    dist.barrier()
    started = time.perf_counter()
    action(*args)
    return time.perf_counter() - started


def _rank(rank: int, world_size: int, path: str, rounds: int, layers: int
          ) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    model, optimizer = _fresh(layers)
    for _ in range(2):
        _step(model, optimizer)
    overlapkit.checkpoint.save(path, model, optimizer)
    times: dict[str, list[float]] = {"load": [], "replay": [], "training step": []}
    for _ in range(rounds):
        fresh, fresh_optimizer = _fresh(layers)
        times["load"].append(_timed(overlapkit.checkpoint.load, path, fresh,
                                    fresh_optimizer))
        times["training step"].append(_timed(_step, fresh, fresh_optimizer))
        other, _ = _fresh(layers)
        times["replay"].append(_timed(replay_layout, Path(path), other))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        per_rank = run_distributed(_rank, args.world_size, timeout=600, args=(
            os.path.join(directory, "checkpoint"), args.rounds, args.layers))
    slowest = {name: [max(rank[name][i] for rank in per_rank) for i in range(args.rounds)]
               for name in per_rank[0]}
    figures = {name: statistics.median(values) for name, values in slowest.items()}
    if args.json:
        print(json.dumps({"median_s": figures, "rounds": slowest}))
        return
    params = args.layers * (2048 * 2048 + 2048)
    print(f"{args.world_size} ranks, {params / 1e6:.0f} M parameters, "
          f"median of {args.rounds} rounds (slowest rank):")
    for name, value in figures.items():
        print(f"  {name}: {value:.3f} s")
    print(f"  replay / load: {figures['replay'] / figures['load']:.2f}")


if __name__ == "__main__":
    main()
