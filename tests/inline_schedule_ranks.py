"""The rank side of tests/test_inline_schedule.py: ``overlap_ddp`` on CPU, its buckets
stepped at the end of backward in runs, in either order, against plain DDP."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from helpers import compare
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.cli.bench.link import HOOK_NAME, SimulatedLink, link_hook, register
from overlapkit.overlap.ddp.comm_threads import CommThreads
from overlapkit.overlap.ddp.inline_schedule import AFTER, FILL, SETTLED, TRIALS

STEPS = 4


def _model(seed: int = 0) -> DDP:
    torch.manual_seed(seed)
    # 12 weights of 16 KiB in buckets of about one weight each
    return DDP(nn.Sequential(*(nn.Linear(64, 64) for _ in range(12))), bucket_cap_mb=0.02)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(100 * rank + step))


def _count_engine_calls(optimizer: Any) -> list[int]:
    """Count the engine's step calls (each steps one run of buckets)."""
    engine = optimizer._stepper.engine
    calls = [0]
    step_plan = engine.step_plan

    def counted(plan: Any) -> None:
        calls[0] += 1
        step_plan(plan)

    engine.step_plan = counted
    return calls


def orders_run(rank: int, world_size: int) -> dict[str, Any]:
    """Each order forced (and the chooser left to itself) against plain DDP + Adam, with
    the ``allreduce`` hook's futures answered by the stepper: parameters, optimizer
    state and ``.grad`` after :data:`STEPS` steps, bitwise; the engine calls per
    backward; how many buckets."""
    plain = _model()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    for step in range(STEPS):
        plain(_batch(rank, step)).square().mean().backward()
        plain_opt.step()
        if step < STEPS - 1:
            plain_opt.zero_grad()
    out: dict[str, Any] = {}
    for order in (FILL, AFTER, None):
        ours = _model()
        opt = overlapkit.overlap_ddp(ours, torch.optim.Adam, lr=0.01)
        stepper = opt._stepper
        if order is not None:
            stepper.schedule.fixed = order
        calls = _count_engine_calls(opt)
        per_backward = []
        for step in range(STEPS):
            calls[0] = 0
            ours(_batch(rank, step)).square().mean().backward()
            per_backward.append(calls[0])
            opt.step()
            if step < STEPS - 1:
                opt.zero_grad()
        out[str(order)] = {
            "params": compare(list(plain.parameters()), list(ours.parameters())),
            "grads": compare([p.grad for p in plain.parameters()],
                             [p.grad for p in ours.parameters()]),
            "state": compare([t for s in plain_opt.state.values() for t in s.values()],
                             [t for s in opt.state.values() for t in s.values()]),
            "calls": per_backward,
            "buckets": len(opt.last_buckets()),
            "answers left": len(stepper._answers),
        }
    return out


def _big_model() -> DDP:
    torch.manual_seed(0)
    # 6 weights of 1 MiB, a bucket each: a bucket's Adam step takes about a millisecond
    return DDP(nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(6))),
               bucket_cap_mb=1)


def link_run(rank: int, world_size: int) -> dict[str, Any]:
    """Over a slow simulated link (each bucket's transfer about 10 x its step, no CPU
    used while it lasts), the chooser keeps the order that steps while the link is
    busy; bitwise plain DDP over a link of its own."""
    register()
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(rank))
    plain = _big_model()
    plain.register_comm_hook(*link_hook(SimulatedLink(gbps=1.0)))
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    ours = _big_model()
    opt = overlapkit.overlap_ddp(ours, torch.optim.Adam, lr=0.01, comm_hook=HOOK_NAME,
                                 comm_hook_options={"link": SimulatedLink(gbps=1.0)})
    for _ in range(2 + TRIALS + 2):  # 2 not measured, TRIALS measured, 2 chosen
        for model, optimizer in ((plain, plain_opt), (ours, opt)):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    schedule = opt._stepper.schedule
    return {"chosen": schedule.chosen, "busy": schedule.busy, "waits": schedule.waits,
            "params": compare(list(plain.parameters()), list(ours.parameters()))}


def sizes_run(rank: int, world_size: int) -> dict[str, Any]:
    """The buckets' mean size the stepper gives its schedule, on real DDP buckets after
    DDP's rebuild, against the parameters' bytes over the buckets DDP made."""
    ours = _model()
    opt = overlapkit.overlap_ddp(ours, torch.optim.Adam, lr=0.01)
    schedule = opt._stepper.schedule
    asked: list[float] = []
    order = schedule.order

    def recorded(bucket_bytes: Any) -> str:
        asked.append(bucket_bytes())
        return order(bucket_bytes)

    schedule.order = recorded
    for step in range(SETTLED + 2):
        ours(_batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    param_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    return {"asked": asked, "expected": param_bytes / len(opt._stepper.last_buckets)}


def threads_link_run(rank: int, world_size: int) -> dict[str, Any]:
    """100 buckets of 256 KiB over an idle simulated link, with 2 intra-op threads per
    rank (as a job with one rank per machine has more): the waits read idle."""
    torch.set_num_threads(2)
    register()
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(*(nn.Linear(256, 256) for _ in range(100))), bucket_cap_mb=0.1)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.Adam, lr=1e-3, comm_hook=HOOK_NAME,
                                 comm_hook_options={"link": SimulatedLink(gbps=1.0)})
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(rank))
    for _ in range(SETTLED + 2):
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    schedule = opt._stepper.schedule
    return {"chosen": schedule.chosen, "spins": schedule.spins, "busy": schedule.busy,
            "waits": schedule.waits}


def comm_threads_run(rank: int, world_size: int) -> dict[str, Any]:
    """gloo's threads, found by name, and their CPU time across some allreduces."""
    threads = CommThreads()
    before_any = threads.cpu_seconds()  # none found yet: the fallback
    tensor = torch.ones(1 << 18)
    dist.all_reduce(tensor)  # gloo starts its worker threads at the first collective
    threads.refresh()
    started = threads.cpu_seconds()
    for _ in range(20):
        dist.all_reduce(tensor)
    return {"found": len(threads.clocks), "spent": threads.cpu_seconds() - started,
            "fallback": isinstance(before_any, float)}
