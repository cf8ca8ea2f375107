"""Benchmark: post-local SGD against plain DDP and torch's post-local SGD.

Measured on the same model, data and ranks, in the same run, after warm-up:

- bytes per step entering global collectives (spanning the whole process group) and
  subgroup collectives, counted by wrapping the comm hooks and the averagers'
  collective calls: the collectives are real, the wrappers only add up the sizes of
  the tensors they are given (``numel * element_size``; what goes on the wire is a
  multiple of that depending on the allreduce algorithm, the same for every variant);
- step time (forward, backward, optimizer step and averaging), the slowest rank's,
  median of interleaved rounds;
- peak RSS per rank (all variants share the processes, so it is one figure per rank).

Variants: ``ddp`` (DDP's allreduce hook and SGD), ``torch_post_local_sgd``
(torch's ``post_localSGD_hook`` with explicit subgroups, ``PeriodicModelAverager``
and ``PostLocalSGDOptimizer``) and ``overlapkit_post_local_sgd``. The goal is
``global bytes per step <= 1.05 / period`` of DDP's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from overlapkit.cli.bench import goal
from overlapkit.cli.memory import peak_rss_mib
from overlapkit.comm_hooks import build_comm_hook
from overlapkit.distributed import run_distributed
from overlapkit.local_sgd.comm_hook import resolved_annotations
from overlapkit.local_sgd.optimizer import PostLocalSGDOptimizer, create_averager

__all__ = ["ByteCounter", "run_benchmark"]

VARIANTS = ("ddp", "torch_post_local_sgd", "overlapkit_post_local_sgd")


class ByteCounter:
    """Bytes handed to collectives, by scope: ``global``, ``subgroup`` or ``none``."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.bytes = {"global": 0, "subgroup": 0, "none": 0}

    def add(self, group: dist.ProcessGroup | None, tensors: list[torch.Tensor]) -> None:
        """Count ``tensors`` as going into a collective over ``group``."""
        size = 1 if group is None else group.size()
        scope = "global" if size == self.world_size else "none" if size == 1 else "subgroup"
        self.bytes[scope] += sum(t.numel() * t.element_size() for t in tensors)

    def reset(self) -> None:
        for scope in self.bytes:
            self.bytes[scope] = 0


def counting_hook(
    hook: Callable[..., Any],
    counter: ByteCounter,
    group_of: Callable[[Any], dist.ProcessGroup | None],
) -> Callable[..., Any]:
    """Wrap a DDP comm hook so each bucket's bytes are counted against the group
    ``group_of(state)`` says the hook is about to use."""

    @resolved_annotations
    def hook_counting_bytes(
        state: Any, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        counter.add(group_of(state), [bucket.buffer()])
        return hook(state, bucket)

    return hook_counting_bytes


def _torch_hook_group(state: Any) -> dist.ProcessGroup | None:
    if state.iter < state.start_localSGD_iter:
        return state.process_group or dist.group.WORLD
    return state.subgroup


def _make_model(config: dict[str, Any]) -> torch.nn.Module:
    torch.manual_seed(0)
    width, depth = config["width"], config["depth"]
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, width))
    return torch.nn.Sequential(*layers)


def _setup(variant: str, config: dict[str, Any], world_size: int,
           counter: ByteCounter) -> tuple[DDP, torch.optim.Optimizer]:
    model = DDP(_make_model(config))
    sgd = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    period, warmup, subgroup_size = (config["period"], config["warmup_steps"],
                                     config["subgroup_size"])
    if variant == "ddp":
        model.register_comm_hook(
            dist.group.WORLD, counting_hook(default_hooks.allreduce_hook, counter, lambda s: s)
        )
        return model, sgd
    if variant == "torch_post_local_sgd":
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState,
            post_localSGD_hook,
        )
        from torch.distributed.algorithms.model_averaging.averagers import (
            PeriodicModelAverager,
        )
        from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGD

        subgroup, _ = dist.new_subgroups(group_size=subgroup_size)
        state = PostLocalSGDState(None, subgroup, start_localSGD_iter=warmup)
        model.register_comm_hook(state, counting_hook(post_localSGD_hook, counter,
                                                      _torch_hook_group))
        torch_averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
        average = torch_averager.average_parameters

        def average_counting(params: Any) -> None:
            step = torch_averager.step
            if step >= warmup and (step - warmup) % period == 0:
                params = list(params)
                counter.add(dist.group.WORLD, [p for g in params for p in g["params"]
                                               if p.grad is not None])
            average(params)

        torch_averager.average_parameters = average_counting  # type: ignore[method-assign]
        return model, TorchPostLocalSGD(sgd, torch_averager)
    state, hook = build_comm_hook("post_local_sgd", process_group=model.process_group,
                                  start_localSGD_iter=warmup, subgroup_size=subgroup_size)
    model.register_comm_hook(state, counting_hook(hook, counter, lambda s: s.current_group))
    averager = create_averager("periodic", period=period, warmup_steps=warmup,
                               process_group=model.process_group)
    average_over = averager.average

    def average_counting_ours(params: list[torch.Tensor], group: dist.ProcessGroup) -> None:
        counter.add(group, params)
        average_over(params, group)

    averager.average = average_counting_ours
    return model, PostLocalSGDOptimizer(sgd, averager, comm_hook_state=state)


def _run_steps(model: DDP, opt: torch.optim.Optimizer, data: list[tuple[Any, Any]],
               start: int, steps: int) -> float:
    dist.barrier()
    began = time.perf_counter()
    for step in range(start, start + steps):
        x, y = data[step % len(data)]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    elapsed = torch.tensor([time.perf_counter() - began])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return float(elapsed.item()) / steps


def _rank_benchmark(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank)
    data = [(torch.randn(config["batch"], config["width"], generator=gen),
             torch.randn(config["batch"], config["width"], generator=gen))
            for _ in range(8)]
    counters = {v: ByteCounter(world_size) for v in VARIANTS}
    runs = {v: _setup(v, config, world_size, counters[v]) for v in VARIANTS}
    warmup_bytes = {}
    for variant, (model, opt) in runs.items():
        _run_steps(model, opt, data, 0, config["warmup_steps"])
        warmup_bytes[variant] = dict(counters[variant].bytes)
        counters[variant].reset()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    step = config["warmup_steps"]
    for _ in range(config["rounds"]):
        for variant, (model, opt) in runs.items():
            times[variant].append(_run_steps(model, opt, data, step, config["steps_per_round"]))
        step += config["steps_per_round"]
    timed_steps = config["rounds"] * config["steps_per_round"]
    params = sum(p.numel() for p in runs["ddp"][0].parameters())
    return {
        "times": times,
        "bytes_per_step": {v: {scope: n / timed_steps for scope, n in c.bytes.items()}
                           for v, c in counters.items()},
        "warmup_bytes_per_step": {v: {s: n / max(1, config["warmup_steps"])
                                      for s, n in b.items()}
                                  for v, b in warmup_bytes.items()},
        "peak_rss_mib": peak_rss_mib(),
        "parameters": params,
    }


def run_benchmark(
    *,
    rounds: int = 5,
    world_size: int = 2,
    quick: bool = False,
    period: int = 4,
    warmup_steps: int = 4,
    subgroup_size: int = 1,
    **options: Any,
) -> dict[str, Any]:
    """Run the benchmark on ``world_size`` local gloo ranks; return its figures.

    :param period: averaging period of both post-local-SGD variants.
    :param warmup_steps: untimed warm-up steps (global gradient averaging).
    :param subgroup_size: ranks per subgroup after warm-up (1: each rank alone).
    :param options: ``width``, ``depth``, ``batch``, ``steps_per_round`` (a multiple
        of ``period``, so every round holds the same number of averagings), ``lr``.
    """
    config: dict[str, Any] = {
        "rounds": rounds, "period": period, "warmup_steps": warmup_steps,
        "subgroup_size": subgroup_size, "lr": 0.01,
        "width": 128 if quick else 512, "depth": 2 if quick else 4,
        "batch": 16 if quick else 64, "steps_per_round": period * (1 if quick else 4),
    }
    config.update(options)
    results = run_distributed(_rank_benchmark, world_size, args=(config,), timeout=600)
    first = results[0]
    variants: dict[str, dict[str, float]] = {}
    for variant in VARIANTS:
        per_step = first["bytes_per_step"][variant]
        variants[variant] = {
            "step_ms": statistics.median(first["times"][variant]) * 1e3,
            "global_bytes_per_step": per_step["global"],
            "subgroup_bytes_per_step": per_step["subgroup"],
        }
    ddp, theirs, ours = (variants[v] for v in VARIANTS)
    global_ratio = ours["global_bytes_per_step"] / ddp["global_bytes_per_step"]
    command = (f"python benchmarks/local_sgd.py --rounds {rounds} --world-size {world_size} "
               f"--period {period} --subgroup-size {subgroup_size}" + (" --quick" if quick
                                                                       else ""))
    return {
        "benchmark": "post_local_sgd",
        "command": command,
        "config": {**config, "world_size": world_size, "parameters": first["parameters"]},
        "variants": variants,
        "ratios": {
            "overlapkit / DDP global bytes per step": global_ratio,
            "overlapkit / DDP step time": ours["step_ms"] / ddp["step_ms"],
            "overlapkit / torch step time": ours["step_ms"] / theirs["step_ms"],
        },
        "goals": [goal("overlapkit / DDP global bytes per step", global_ratio,
                       at_most=1.05 / period)],
        "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in results],
        "warmup_bytes_per_step": first["warmup_bytes_per_step"],
        "notes": (
            "bytes are tensor bytes handed to collectives after warm-up, counted by "
            "wrapping comm hooks and averagers (real gloo collectives); step time is the "
            "slowest rank's, median of interleaved rounds; all variants share the rank "
            "processes, so peak RSS is one figure per rank."
        ),
    }
