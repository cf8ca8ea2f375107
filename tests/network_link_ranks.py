"""The rank side of tests/test_bench_network_bound.py: DDP backwards over the simulated
link, timed in wall-clock and in process CPU time."""

from __future__ import annotations

import time
from typing import Any

import torch
from helpers import compare
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.cli.bench.link import HOOK_NAME, SimulatedLink, link_hook, register


def _model(buckets: int) -> DDP:
    torch.manual_seed(0)
    # one 4 MiB weight per bucket: backward itself takes a few milliseconds
    model = nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(buckets)))
    return DDP(model, bucket_cap_mb=4)


def delayed_backward(rank: int, world_size: int, gbps: float, buckets: int
                     ) -> dict[str, Any]:
    """One backward of plain DDP over the link (after a warm-up backward that lets DDP
    rebuild its buckets): its wall time, the process's CPU time meanwhile, the
    modelled transfer time, and whether the gradients are those of DDP without it."""
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(rank))
    reference = _model(buckets)
    reference(x).sum().backward()
    link = SimulatedLink(gbps=gbps, latency_us=10.0, ranks=8)
    delayed = _model(buckets)
    delayed.register_comm_hook(*link_hook(link))
    delayed(x).sum().backward()  # warm-up: DDP rebuilds its buckets
    delayed.zero_grad(set_to_none=True)
    link.take_counts()
    loss = delayed(x).sum()
    wall, cpu = time.perf_counter(), time.process_time()
    loss.backward()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    modelled, transfers = link.take_counts()
    return {"wall_s": wall, "cpu_s": cpu, "modelled_s": modelled, "transfers": transfers,
            "grads": compare([p.grad for p in reference.parameters()],
                             [p.grad for p in delayed.parameters()])}


def overlap_ddp_over_the_link(rank: int, world_size: int) -> dict[str, Any]:
    """Two steps of overlap_ddp with ``comm_hook="simulated_link"`` against plain DDP
    with the same hook: the parameters after them, compared bitwise."""
    register()
    link = SimulatedLink(gbps=5.0)
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(rank))
    plain = _model(2)
    plain.register_comm_hook(*link_hook(link))
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    ours = _model(2)
    ours_opt = overlapkit.overlap_ddp(ours, torch.optim.Adam, lr=0.01, comm_hook=HOOK_NAME,
                                      comm_hook_options={"link": link})
    for _ in range(2):
        for model, opt in ((plain, plain_opt), (ours, ours_opt)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return {"params": compare(list(plain.parameters()), list(ours.parameters())),
            "transfers": link.take_counts()[1]}
