"""Benchmark: where the network is the bottleneck. Plain DDP, ``overlap_ddp`` (stepping on
the backward thread, the default, and on the comm thread), torch's own overlap
(``_hook_then_optimizer``, what ``DDP._register_fused_optim`` registers), sharded
``overlap_ddp`` and ``ZeroRedundancyOptimizer``, each over the same simulated link
(:mod:`overlapkit.cli.bench.link`) at several link speeds.

On one machine the ranks reduce over loopback in microseconds: no step can hide behind
that. Here every variant's buckets complete no earlier than a ring allreduce among
``ranks`` (default 8) ranks would over a serial link of the given speed, through the
same comm hook (``overlap_ddp`` and sharded: ``comm_hook="simulated_link"``; plain DDP
and ZeRO: the hook registered by hand; torch's: wrapped in its
``_hook_then_optimizer``). The link waits on a timer thread, so the cores stay with
backward and the steps, as with a network card.

What overlap promises: where communication takes at least as long as the backward, the
optimizer step runs while later buckets are still on the wire, so a step takes about
plain's time less the time of plain's ``step()``; the goal asks for at least 0.8 of
plain's ``step()`` time (measured in the same run) saved, and sharded no slower than
ZeRO. Where communication is shorter than the backward, the ratios are shown and not
judged.

Method: the variants are built once per rank; in every round, at every link speed,
they take turns step by step (the order rotating), ``steps`` timed steps each (forward
+ backward + step + zero_grad, ranks meeting at a barrier before each, the slowest
rank's time); a round's figure is a variant's median step; reported: the median over
rounds. ``plain`` also times its ``step()`` alone (``optimizer_step_ms``) and
``compute_only`` its backward alone (``backward_ms``; forward + backward without DDP or
step). The saving of ``overlap_ddp`` is paired step by step: ``(plain - overlap_ddp) /
plain's step()`` of neighbouring steps, median over every step of every round.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from overlapkit.cli.bench import goal, torchscript_warnings_silenced
from overlapkit.cli.bench.link import HOOK_NAME, SimulatedLink, link_hook, register
from overlapkit.cli.bench.timing import mlp, paired_ratio, rotated

__all__ = ["SPEEDS_CPU", "SPEEDS_CUDA", "VARIANTS", "run_benchmark"]

COMMAND = "overlapkit bench --only network_bound"
LR = 1e-3
#: the variants over the link, in the order they are listed; compute_only runs no link
VARIANTS = ("plain", "overlap_ddp", "overlap_ddp_comm_thread", "torch_overlap", "sharded",
            "zero")
#: link speeds (Gb/s): on CPU communication goes from well under the backward to
#: several times it on the full model; on a GPU the backward is ~100x shorter
SPEEDS_CPU = (40.0, 10.0, 5.0, 2.0, 1.0)
SPEEDS_CUDA = (400.0, 100.0, 50.0, 25.0)
QUICK_SPEEDS = (10.0, 1.0)
#: (width, depth, batch, DDP bucket_cap_mb): 8 x Linear(1024) = 8.4 M parameters
FULL = (1024, 8, 64, 4.0)
QUICK = (256, 4, 16, 0.25)
#: the simulated ring's ranks and per-message latency
RING_RANKS = 8
LATENCY_US = 10.0


class _Variant:
    """One variant's model and optimizer over ``link``, and a ``train_step(x)``."""

    def __init__(self, name: str, shape: tuple[int, int, int, float], link: SimulatedLink,
                 device: torch.device | None) -> None:
        import overlapkit

        width, depth, _, cap = shape
        model = mlp(width, depth)
        if device is not None:
            model = model.to(device)
        self.name = name
        self.device = device
        self.optimizer: Any = None
        #: plain: the time of each step() call (s); compute_only: of each backward
        self.inner_times: list[float] = []
        if name == "compute_only":
            self.model: Any = model
            return
        self.model = DDP(model, bucket_cap_mb=cap,
                         device_ids=None if device is None else [device.index])
        if name in ("overlap_ddp", "overlap_ddp_comm_thread", "sharded"):
            self.optimizer = overlapkit.overlap_ddp(
                self.model, torch.optim.Adam, lr=LR, comm_hook=HOOK_NAME,
                comm_hook_options={"link": link}, shard_optimizer_state=name == "sharded",
                step_thread="comm" if name.endswith("comm_thread") else "backward")
        elif name == "torch_overlap":
            # what DDP._register_fused_optim registers, with the link's hook in place
            # of its hard-wired allreduce_hook
            from torch.distributed.algorithms._optimizer_overlap import _as_overlapped_optim
            from torch.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
                _hook_then_optimizer,
            )

            with torchscript_warnings_silenced():  # functional optimizers are scripted
                overlapped = _as_overlapped_optim(torch.optim.Adam, None, lr=LR)
            state, hook = link_hook(link)
            self.model.register_comm_hook(
                state, _hook_then_optimizer(hook, overlapped._opt_hook_state))
        else:
            self.model.register_comm_hook(*link_hook(link))
            if name == "plain":
                self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LR)
            elif name == "zero":
                from torch.distributed.optim import ZeroRedundancyOptimizer

                self.optimizer = ZeroRedundancyOptimizer(
                    self.model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
            else:
                raise ValueError(f"unknown variant {name!r}")

    def _sync(self) -> None:
        if self.device is not None:
            torch.cuda.synchronize(self.device)

    def train_step(self, x: torch.Tensor) -> None:
        self._sync()  # time the step, not what came before
        loss = self.model(x).square().mean()
        if self.name == "compute_only":
            started = time.perf_counter()
            loss.backward()
            self._sync()
            self.inner_times.append(time.perf_counter() - started)
            self.model.zero_grad(set_to_none=True)
            return
        loss.backward()
        if self.optimizer is None:  # torch_overlap: stepped in the comm hook
            self.model.zero_grad(set_to_none=True)
        elif self.name == "plain":
            self._sync()
            started = time.perf_counter()
            self.optimizer.step()
            self._sync()
            self.inner_times.append(time.perf_counter() - started)
            self.optimizer.zero_grad()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad()
        self._sync()


def _timing_rank(rank: int, world_size: int, shape: tuple[int, int, int, float],
                 speeds: tuple[float, ...], rounds: int, steps: int, warmup: int,
                 device: str) -> dict[str, Any]:
    """Every variant's step times (s), per link speed, round and step; plain's
    ``step()`` alone beside them (``optimizer_step``), compute_only's backward alone
    (``backward``, at the first speed: it has no link) and the modelled link time."""
    register()
    where = torch.device("cuda", rank) if device == "cuda" else None
    link = SimulatedLink(gbps=speeds[0], latency_us=LATENCY_US, ranks=RING_RANKS)
    names = [*VARIANTS, "compute_only"]
    variants = {name: _Variant(name, shape, link, where) for name in names}
    width, _, batch_size, _ = shape
    batch = torch.randn(batch_size, width, generator=torch.Generator().manual_seed(rank))
    if where is not None:
        batch = batch.to(where)
    for variant in variants.values():
        for _ in range(warmup):
            variant.train_step(batch)
        variant.inner_times.clear()
    times: dict[str, dict[str, list[list[float]]]] = {
        _label(speed): {name: [] for name in [*names, "optimizer_step", "backward"]}
        for speed in speeds}
    comm_s: dict[str, float] = {}
    for round_index in range(rounds):
        for speed in speeds:
            link.gbps = speed
            link.take_counts()
            per_step = times[_label(speed)]
            order = names if speed == speeds[0] else list(VARIANTS)
            for figures in per_step.values():
                figures.append([])
            # the variants take turns step by step (the order rotating), so that load
            # from other processes, seconds long, falls on each of them alike
            for step in range(steps):
                for name in rotated(order, round_index + step):
                    variant = variants[name]
                    dist.barrier()
                    started = time.perf_counter()
                    variant.train_step(batch)
                    per_step[name][-1].append(time.perf_counter() - started)
                    if variant.inner_times:
                        inner = "backward" if name == "compute_only" else "optimizer_step"
                        per_step[inner][-1].append(variant.inner_times.pop())
            modelled, _ = link.take_counts()
            comm_s[_label(speed)] = modelled / (steps * len(VARIANTS))
    return {"times": times, "comm_s": comm_s}


def _label(speed: float) -> str:
    return f"{speed:g}gbps"


def _slowest(per_rank: list[dict[str, Any]], label: str, name: str) -> list[list[float]]:
    """Per round and step, the slowest rank's time of ``name`` at ``label``: the ranks
    met at a barrier before the step, which is as slow as its slowest rank."""
    runs = [rank["times"][label][name] for rank in per_rank]
    return [[max(values) for values in zip(*steps, strict=True)]
            for steps in zip(*runs, strict=True)]


def _per_round(times: list[list[float]]) -> list[float]:
    return [statistics.median(steps) for steps in times]


def run_benchmark(*, rounds: int = 5, world_size: int = 2, quick: bool = False,
                  **options: Any) -> dict[str, Any]:
    """Run the benchmark; return a JSON-serialisable dict of medians and ratios.

    :param rounds: interleaved rounds; every variant runs ``steps`` timed steps per
        round at every link speed.
    :param quick: a small model, two link speeds, few steps: a check that it runs.
    :param options: ``speeds`` (Gb/s), ``steps``, ``warmup``, ``device`` (``"cpu"``, or
        ``"cuda"``: NCCL, one GPU per rank).
    """
    device = str(options.get("device", "cpu"))
    backend = "nccl" if device == "cuda" else "gloo"
    shape = QUICK if quick else FULL
    default_speeds = QUICK_SPEEDS if quick else SPEEDS_CUDA if device == "cuda" else SPEEDS_CPU
    speeds = tuple(float(s) for s in options.get("speeds", default_speeds))
    steps = int(options.get("steps", 2 if quick else 6))
    warmup = int(options.get("warmup", 2 if quick else 3))
    from overlapkit.distributed import run_distributed

    per_rank = run_distributed(_timing_rank, world_size,
                               args=(shape, speeds, rounds, steps, warmup, device),
                               timeout=1800, backend=backend)
    first = _label(speeds[0])
    backward_ms = 1000 * statistics.median(_per_round(_slowest(per_rank, first, "backward")))
    variants: dict[str, dict[str, Any]] = {"compute_only": {
        "step_ms": 1000 * statistics.median(_per_round(_slowest(per_rank, first,
                                                                "compute_only"))),
        "backward_ms": backward_ms}}
    ratios: dict[str, float] = {}
    goals = []
    plot: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for speed in speeds:
        label = _label(speed)
        comm_ms = 1000 * per_rank[0]["comm_s"][label]
        raw = {name: _slowest(per_rank, label, name) for name in VARIANTS}
        slowest = {name: _per_round(raw[name]) for name in VARIANTS}
        calls = _slowest(per_rank, label, "optimizer_step")
        for name in VARIANTS:
            variants[f"{label}/{name}"] = {"step_ms": 1000 * statistics.median(slowest[name]),
                                           "link_comm_ms": comm_ms}
            plot[name].append(paired_ratio(slowest[name], slowest["plain"]))
        variants[f"{label}/plain"]["optimizer_step_ms"] = 1000 * statistics.median(
            _per_round(calls))
        # paired step by step (plain's step() timed inside its own step), then the median
        saved = statistics.median(
            (plain - ours) / call
            for round_plain, round_ours, round_calls in zip(
                raw["plain"], raw["overlap_ddp"], calls, strict=True)
            for plain, ours, call in zip(round_plain, round_ours, round_calls, strict=True))
        sharded_zero = paired_ratio(slowest["sharded"], slowest["zero"])
        ratios[f"{label}: link comm / backward"] = comm_ms / backward_ms
        ratios[f"{label}: overlap_ddp / plain step time"] = paired_ratio(
            slowest["overlap_ddp"], slowest["plain"])
        ratios[f"{label}: overlap_ddp / torch_overlap step time"] = paired_ratio(
            slowest["overlap_ddp"], slowest["torch_overlap"])
        ratios[f"{label}: overlap_ddp_comm_thread / torch_overlap step time"] = paired_ratio(
            slowest["overlap_ddp_comm_thread"], slowest["torch_overlap"])
        ratios[f"{label}: (plain - overlap_ddp) / plain step()"] = saved
        ratios[f"{label}: sharded / zero step time"] = sharded_zero
        if comm_ms >= backward_ms:  # where the goals apply: see the module
            goals += [goal(f"{label}: (plain - overlap_ddp) / plain step()", saved,
                           at_least=0.8, judged=not quick),
                      goal(f"{label}: sharded / zero step time", sharded_zero, at_most=1.0,
                           judged=not quick)]
    width, depth, batch, cap = shape
    params = sum(p.numel() for p in mlp(width, depth).parameters())
    return {
        "benchmark": "network_bound",
        "command": COMMAND + (" --quick" if quick else ""),
        "variants": variants,
        "ratios": ratios,
        "goals": goals,
        "plot": {"x": "link Gb/s", "y": "step time / plain's", "xs": list(speeds),
                 "series": plot},
        "notes": (
            f"{world_size} "
            + ("NCCL ranks, one GPU each" if device == "cuda" else "gloo ranks on CPU, 1 "
               "thread each")
            + f"; every bucket's allreduce completes no earlier than a ring allreduce "
            f"among {RING_RANKS} ranks on a serial link of the row's speed, "
            f"{LATENCY_US:g} us per message (link_comm_ms: modelled per step). MLP "
            f"{depth} x Linear({width}) = {params / 1e6:.2f} M parameters, batch {batch}, "
            f"bucket_cap_mb={cap}, Adam lr={LR}; median of {rounds} interleaved rounds of "
            f"{steps} steps after {warmup} warm-up steps (slowest rank), the variants taking turns "
            "step by step; ratios: medians of the per-round ratios, the saving paired "
            "step by step. Goals where link comm >= backward: overlap_ddp "
            "saves >= 0.8 x plain's step() (optimizer_step_ms), sharded <= ZeRO. The "
            "exchange of sharded and ZeRO's broadcasts are not delayed by the link."
        ),
    }
