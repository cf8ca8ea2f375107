"""Where each rank's CPU goes in a DDP step, thread by thread: plain DDP against
``overlap_ddp`` in a forced order of the end-of-backward steps.

Two gloo ranks, the ``mlp`` model of ``overlapkit bench --only overlap_ddp`` (6 x
``Linear(1024)`` + Tanh, ``bucket_cap_mb=1``), Adam lr 1e-3, batch 32. Each variant
runs 6 rounds of 10 steps, alternating; per round, the wall time per step and each
thread's CPU time per step (``/proc/self/task/*/stat``, Linux only), medians over
rounds, from each rank.

    PYTHONPATH=$PWD python benchmarks/ddp_thread_cpu.py [plain,after,fill]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.cli.bench.timing import mlp
from overlapkit.distributed import run_distributed

ROUNDS, STEPS, WARM_UP = 6, 10, 20
TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def thread_ticks() -> dict[str, int]:
    """CPU ticks (user + system) of each thread of this process, by ``name/tid``."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as comm:
                name = comm.read().strip()
        except OSError:
            continue
        ticks[f"{name}/{tid}"] = int(fields[11]) + int(fields[12])
    return ticks


def _rank(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    batch = torch.randn(32, 1024)
    variants = {}
    for name in names:
        model = DDP(mlp(1024, 6), bucket_cap_mb=1.0)
        if name == "plain":
            optimizer: Any = torch.optim.Adam(model.parameters(), lr=1e-3)
        else:
            optimizer = overlapkit.overlap_ddp(model, torch.optim.Adam, lr=1e-3)
            optimizer._stepper.schedule.fixed = name  # "after" or "fill"
        variants[name] = (model, optimizer)

    def step(model: Any, optimizer: Any) -> None:
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for model, optimizer in variants.values():
        for _ in range(WARM_UP):
            step(model, optimizer)
    rounds: dict[str, list[tuple[float, dict[str, float]]]] = {name: [] for name in names}
    for index in range(ROUNDS):
        for name in names if index % 2 else names[::-1]:
            dist.barrier()
            before, started = thread_ticks(), time.perf_counter()
            for _ in range(STEPS):
                step(*variants[name])
            wall = (time.perf_counter() - started) * 1000 / STEPS
            after = thread_ticks()
            cpu: dict[str, float] = {}
            for key, ticks in after.items():  # summed over the threads of one name
                thread = key.split("/")[0]
                spent = (ticks - before.get(key, 0)) * TICK_MS / STEPS
                cpu[thread] = cpu.get(thread, 0.0) + spent
            rounds[name].append((wall, cpu))
    result = {}
    for name, rows in rounds.items():
        threads = sorted(set().union(*(cpu for _, cpu in rows)))
        result[name] = {"wall ms": round(statistics.median(w for w, _ in rows), 2),
                        **{f"{t} cpu ms": round(statistics.median(c.get(t, 0.0)
                                                                  for _, c in rows), 1)
                           for t in threads}}
    return result


def main() -> None:
    names = (sys.argv[1] if len(sys.argv) > 1 else "plain,after,fill").split(",")
    for rank, result in enumerate(run_distributed(_rank, 2, args=(names,), timeout=600)):
        for name, figures in result.items():
            print(f"rank {rank} {name}: {figures}")


if __name__ == "__main__":
    main()
