"""Where a step of the small MLP goes on one GPU: plain DDP + ``step()`` against
``overlap_ddp`` (issue 33, item 4). One NCCL rank, ``overlapkit bench``'s ``mlp`` model
(6 x Linear(1024) + Tanh, 1 MB buckets, Adam, batch 32); ``torch.profiler`` over 20
steps after 10 warm-up steps, then the ops that take the most self CPU and self CUDA
time, and the kernel launches per step.

    usage (on a CUDA machine, from the repository root):
        PYTHONPATH=$PWD python benchmarks/gpu_profile_mlp.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

import overlapkit
from overlapkit.cli.bench.timing import mlp

WARMUP, STEPS = 10, 20


def _variant(name: str, device: torch.device) -> tuple[DDP, torch.optim.Optimizer]:
    ddp = DDP(mlp(1024, 6).to(device), bucket_cap_mb=1.0, device_ids=[device.index])
    if name == "overlap_ddp":
        return ddp, overlapkit.overlap_ddp(ddp, torch.optim.Adam, lr=1e-3)
    return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-3)


def _step(ddp: DDP, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    ddp(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    x = torch.randn(32, 1024, device=device)
    for name in ("plain", "overlap_ddp"):
        ddp, optimizer = _variant(name, device)
        for _ in range(WARMUP):
            _step(ddp, optimizer, x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(STEPS):
            _step(ddp, optimizer, x)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / STEPS
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                _step(ddp, optimizer, x)
            torch.cuda.synchronize()
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel",
                                                           "cuLaunchKernel",
                                                           "cudaLaunchKernelExC"))
        syncs = sum(e.count for e in events if "Synchronize" in e.key
                    or e.key == "cudaStreamWaitEvent")
        print(f"== {name}: {wall_ms:.2f} ms per step (unprofiled), "
              f"{launches / STEPS:.0f} kernel launches and {syncs / STEPS:.0f} "
              "stream syncs/waits per step")
        print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
        print(events.table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=48))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
