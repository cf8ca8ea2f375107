"""Where one bucket's cost goes: the phases of a one-rank step, in thread CPU time.

One process, one gloo rank, 100 x ``Linear(256, 256)`` under DDP with
``bucket_cap_mb=0.1`` (100 buckets of two parameters, the ``100_buckets`` model of
``overlapkit bench --only engine_overhead``), Adam lr 1e-3, batch 8. Three variants in
turn, 3 rounds of 20 steps each: plain DDP + ``step()``; the same with overlapkit's
``allreduce`` comm hook registered by hand; ``overlap_ddp``. For each: forward,
backward, ``step()``, ``zero_grad()`` and (``overlap_ddp``) the time spent inside the
engine's ``step_plan`` during backward, medians in ms. ``--noop-step`` makes the
engine's step a no-op: what is left of ours' backward above the comm hook's is the
stepper's own Python per bucket.

    PYTHONPATH=$PWD python benchmarks/bucket_cost.py [--noop-step]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.overlap.core import engine as engine_module
from overlapkit.overlap.core.generic import GenericOverlapEngine

_IN_STEP = [0.0]


def _timed_step_plan(original: Any) -> Any:
    def step_plan(self: Any, plan: Any) -> None:
        started = time.thread_time()
        original(self, plan)
        _IN_STEP[0] += time.thread_time() - started
    return step_plan


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(100)])


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    engine_module.OverlapEngine.step_plan = _timed_step_plan(  # type: ignore[method-assign]
        engine_module.OverlapEngine.step_plan)
    if "--noop-step" in sys.argv:
        GenericOverlapEngine.step_groups = lambda self, groups: None  # type: ignore[method-assign]
    batch = torch.randn(8, 256)
    variants: dict[str, tuple[nn.Module, Any]] = {}
    model = DDP(_build(), bucket_cap_mb=0.1)
    variants["plain"] = (model, torch.optim.Adam(model.parameters(), lr=1e-3))
    model = DDP(_build(), bucket_cap_mb=0.1)
    model.register_comm_hook(*overlapkit.build_comm_hook("allreduce"))
    variants["plain + comm hook"] = (model, torch.optim.Adam(model.parameters(), lr=1e-3))
    model = DDP(_build(), bucket_cap_mb=0.1)
    variants["overlap_ddp"] = (model, overlapkit.overlap_ddp(model, torch.optim.Adam, lr=1e-3))

    def step(model: nn.Module, optimizer: Any) -> list[float]:
        t0 = time.thread_time()
        loss = model(batch).square().mean()
        t1 = time.thread_time()
        _IN_STEP[0] = 0.0
        loss.backward()
        t2 = time.thread_time()
        optimizer.step()
        t3 = time.thread_time()
        optimizer.zero_grad()
        t4 = time.thread_time()
        return [t1 - t0, t2 - t1, t3 - t2, t4 - t3, _IN_STEP[0]]

    for variant in variants.values():
        for _ in range(3):  # DDP rebuilds its buckets after the first iteration
            step(*variant)
    print("ms per step (thread CPU): forward / backward / step / zero_grad / "
          "in step_plan during backward / total")
    for round_index in range(3):
        for name, variant in variants.items():
            rows = [step(*variant) for _ in range(20)]
            medians = [1000 * statistics.median(column) for column in zip(*rows, strict=True)]
            total = sum(medians[:4])
            print(round_index, f"{name:18}", " / ".join(f"{m:.2f}" for m in medians),
                  f"/ {total:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
