"""How a CPU rank waits for its reductions at the end of backward, and in which order
it steps: ms per training step of `overlap_ddp` with the order and the wait forced,
beside plain DDP, 2 gloo ranks (``--ranks``: more ranks on the same cores).

    PYTHONPATH=$PWD python benchmarks/inline_waits.py [--steps 50] [--models mlp,100,400]
        [--ranks 2]

Each (model, variant) runs in fresh processes: 20 warm-up steps, then the median of
``--steps`` steps per rank. "spin": waits keep the core, yielding it (what a rank does
unless its waits are idle); "block": `future.wait()`, as plain DDP's finalize waits.
The figures in docs/benchmarks.md (issue 33, item 2).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.cli.bench import link
from overlapkit.cli.bench.timing import mlp
from overlapkit.distributed import run_distributed

#: name -> (width, depth, bucket_cap_mb, with Tanh); "link10": network_bound's model
#: (8 x Linear(1024), 4 MB buckets, batch 64) over its simulated 10 Gb/s link
MODELS = {
    "link10": (1024, 8, 4.0, True),
    "mlp": (1024, 6, 1.0, True),  # overlap_ddp's benchmark: 6 buckets of 4 MiB
    "50": (512, 50, 0.5, False),  # engine_overhead's 50_buckets (1 MiB each)
    "100": (256, 100, 0.1, False),  # its 100_buckets (256 KiB)
    "400": (64, 200, 0.0001, False),  # its 400_buckets (16 KiB weights, biases)
    "1": (64, 200, 25.0, False),  # its 1_bucket
}
VARIANTS = ("plain", "after spin", "after block", "fill spin", "fill block")
WARMUP = 20


def _rank(rank: int, world_size: int, model: str, variant: str, steps: int) -> float:
    width, depth, cap, tanh = MODELS[model]
    module = (mlp(width, depth) if tanh
              else nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]))
    ddp = DDP(module, bucket_cap_mb=cap)
    over_link: dict[str, Any] = {}
    if model == "link10":
        link.register()
        simulated = link.SimulatedLink(gbps=10.0, latency_us=10.0, ranks=8)
        over_link = {"comm_hook": link.HOOK_NAME, "comm_hook_options": {"link": simulated}}
        if variant == "plain":
            ddp.register_comm_hook(*link.link_hook(simulated))
    if variant == "plain":
        optimizer: torch.optim.Optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    else:
        optimizer = overlapkit.overlap_ddp(ddp, torch.optim.Adam, lr=1e-3, **over_link)
        order, wait = variant.split()
        schedule = optimizer._stepper.schedule
        schedule.fixed, schedule.fixed_spin = order, wait == "spin"
    batch = torch.randn(64 if model == "link10" else 32, width,
                        generator=torch.Generator().manual_seed(rank))
    times = []
    for index in range(WARMUP + steps):
        started = time.perf_counter()
        ddp(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if index >= WARMUP:
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--models", default="mlp,50,100,400,1,link10")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    print("| model | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---:|" * len(VARIANTS))
    for model in args.models.split(","):
        cells = []
        for variant in VARIANTS:
            per_rank = run_distributed(_rank, args.ranks, args=(model, variant, args.steps),
                                       timeout=600)
            cells.append(f"{max(per_rank):.1f}")
        print(f"| {model} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
