"""Benchmark: what the overlap engine itself costs per bucket and per parameter.

``overlap_ddp`` against plain DDP + ``step()`` (Adam) on models with 1 to 400 gradient
buckets, and ``optimizer_in_backward`` against the plain loop on a plain module with 400
parameters, at 1 and 2 gloo ranks. With one rank there is no communication, so no
overlap to gain or lose: what ours costs above plain is the engine's own work (the comm
hook's Python, grouping, the optimizer call per bucket), reported per bucket and per
parameter in microseconds. A third DDP variant, plain DDP + ``step()`` with overlapkit's
``allreduce`` comm hook registered by hand, splits that cost in two: what any Python
comm hook costs DDP per bucket, and what stepping each bucket during backward adds.

Every variant of one rank count lives in the same spawned processes (same initial
weights, same data); the variants take turns in every round (the order rotates), each
round's figure is the median step time (forward + backward + step + zero_grad) over its
timed steps, and the result is the median over rounds, slowest rank.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from overlapkit.cli.bench import goal
from overlapkit.cli.bench.timing import slowest_per_round
from overlapkit.distributed import run_distributed
from overlapkit.overlap.ddp.inline_schedule import SETTLED

__all__ = ["GOALS", "MODELS", "ModelSpec", "run_benchmark"]

COMMAND = "python benchmarks/engine_overhead.py"
LR = 1e-3
BATCH = 8
#: the model optimizer_in_backward steps parameter by parameter (400 parameters)
MODULE_MODEL = "1_bucket"
#: goals of issue 15: ours / plain per rank count, and microseconds per bucket
GOALS = {"ratio_1_rank": 1.03, "ratio_2_ranks": 1.05, "us_per_bucket": 30.0,
         "module_ratio": 1.05}


@attrs.frozen
class ModelSpec:
    """``depth`` x ``Linear(width, width)`` under DDP with ``bucket_cap_mb``."""

    width: int
    depth: int
    quick_depth: int
    bucket_cap_mb: float
    description: str


#: model name -> spec; the bucket counts are what DDP builds after its first iteration
MODELS: dict[str, ModelSpec] = {
    "1_bucket": ModelSpec(64, 200, 20, 25.0, "200 x Linear(64, 64), default cap"),
    "50_buckets": ModelSpec(512, 50, 5, 0.5, "50 x Linear(512, 512), bucket_cap_mb=0.5"),
    "100_buckets": ModelSpec(256, 100, 10, 0.1, "100 x Linear(256, 256), bucket_cap_mb=0.1"),
    "400_buckets": ModelSpec(64, 200, 20, 0.0001,
                             "200 x Linear(64, 64), bucket_cap_mb=0.0001"),
}


def _build(spec: ModelSpec, quick: bool) -> nn.Module:
    torch.manual_seed(0)
    depth = spec.quick_depth if quick else spec.depth
    return nn.Sequential(*[nn.Linear(spec.width, spec.width) for _ in range(depth)])


class _Variant:
    """One model with one optimizer set-up, and its ``train_step()``."""

    def __init__(self, model_name: str, technique: str, quick: bool) -> None:
        import overlapkit

        spec = MODELS[model_name]
        module = _build(spec, quick)
        self.batch = torch.randn(BATCH, spec.width,
                                 generator=torch.Generator().manual_seed(dist.get_rank()))
        self.params = sum(1 for _ in module.parameters())
        self.model: nn.Module
        self.optimizer: Any
        if technique == "optimizer_in_backward":
            self.model = module
            self.optimizer = overlapkit.optimizer_in_backward(module, torch.optim.Adam, lr=LR)
        elif technique == "module_plain":
            self.model = module
            self.optimizer = torch.optim.Adam(module.parameters(), lr=LR)
        else:
            self.model = DDP(module, bucket_cap_mb=spec.bucket_cap_mb)
            if technique == "overlap_ddp":
                self.optimizer = overlapkit.overlap_ddp(self.model, torch.optim.Adam, lr=LR)
            else:
                if technique == "plain_comm_hook":
                    self.model.register_comm_hook(*overlapkit.build_comm_hook("allreduce"))
                self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LR)

    def train_step(self) -> None:
        self.model(self.batch).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def buckets(self) -> int | None:
        """DDP's bucket count as the overlapped optimizer saw it last backward."""
        last_buckets = getattr(self.optimizer, "last_buckets", None)
        return None if last_buckets is None else len(last_buckets())


def variant_names(models: list[str]) -> list[str]:
    """``model/technique`` for every variant the rank runs."""
    names = [f"{m}/{t}" for m in models for t in ("plain", "plain_comm_hook", "overlap_ddp")]
    if MODULE_MODEL in models:
        names += [f"{MODULE_MODEL}/module_plain", f"{MODULE_MODEL}/optimizer_in_backward"]
    return names


def _timing_rank(rank: int, world_size: int, models: list[str], rounds: int, steps: int,
                 warmup: int, quick: bool) -> dict[str, Any]:
    names = variant_names(models)
    variants = {name: _Variant(name.split("/")[0], name.split("/")[1], quick)
                for name in names}
    for variant in variants.values():
        for _ in range(warmup):  # DDP rebuilds its buckets after the first iteration
            variant.train_step()
    per_round: dict[str, list[float]] = {name: [] for name in names}
    # the training thread's CPU time: what other processes on the cores change least
    cpu_per_round: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            variant = variants[name]
            times, cpu_times = [], []
            for _ in range(steps):
                dist.barrier()
                started, cpu_started = time.perf_counter(), time.thread_time()
                variant.train_step()
                cpu_times.append(time.thread_time() - cpu_started)
                times.append(time.perf_counter() - started)
            per_round[name].append(statistics.median(times))
            cpu_per_round[name].append(statistics.median(cpu_times))
    shapes = {name: {"buckets": v.buckets(), "params": v.params}
              for name, v in variants.items()}
    return {"per_round": per_round, "cpu_per_round": cpu_per_round, "shapes": shapes}


def _rank_label(ranks: int) -> str:
    return f"{ranks} rank" if ranks == 1 else f"{ranks} ranks"


def _figures(ranks: int, per_rank: list[dict[str, Any]], rounds: int, models: list[str],
             quick: bool
             ) -> tuple[dict[str, dict[str, float]], dict[str, float], list[dict[str, Any]]]:
    """Variant figures (median over rounds of the slowest rank), ratios and goals."""
    variants: dict[str, dict[str, float]] = {}
    shapes = per_rank[0]["shapes"]
    for name in variant_names(models):
        slowest = slowest_per_round([r["per_round"] for r in per_rank], name)
        busiest = slowest_per_round([r["cpu_per_round"] for r in per_rank], name)
        model_name = name.split("/")[0]
        buckets = shapes[f"{model_name}/overlap_ddp"]["buckets"]
        variants[f"{ranks}r/{name}"] = {"step_ms": 1000 * statistics.median(slowest),
                                        "cpu_ms": 1000 * statistics.median(busiest),
                                        "buckets": float(buckets or 0),
                                        "params": float(shapes[name]["params"])}
    ratio_goal = GOALS["ratio_1_rank"] if ranks == 1 else GOALS["ratio_2_ranks"]
    ratios: dict[str, float] = {}
    goals: list[dict[str, Any]] = []
    pairs = [(m, "plain", "overlap_ddp") for m in models]
    if MODULE_MODEL in models:
        pairs.append((MODULE_MODEL, "module_plain", "optimizer_in_backward"))
    for model_name, plain_name, ours_name in pairs:
        plain = variants[f"{ranks}r/{model_name}/{plain_name}"]
        ours = variants[f"{ranks}r/{model_name}/{ours_name}"]
        label = f"{_rank_label(ranks)}, {model_name}"
        row_goal = (GOALS["module_ratio"] if ours_name == "optimizer_in_backward"
                    else ratio_goal)
        ratios[f"{label}: {ours_name} / plain (goal <= {row_goal})"] = (
            ours["step_ms"] / plain["step_ms"])
        goals.append(goal(f"{label}: {ours_name} / plain step time",
                          ours["step_ms"] / plain["step_ms"], at_most=row_goal,
                          judged=not quick))
        ratios[f"{label}: {ours_name} / plain, CPU time"] = ours["cpu_ms"] / plain["cpu_ms"]
        if ranks != 1:
            continue
        extra_us = 1000 * (ours["step_ms"] - plain["step_ms"])
        ratios[f"{label}: {ours_name} us per parameter"] = extra_us / ours["params"]
        if ours_name != "overlap_ddp":
            continue
        hooked = variants[f"{ranks}r/{model_name}/plain_comm_hook"]
        hook_us = 1000 * (hooked["step_ms"] - plain["step_ms"])
        ratios[f"{label}: engine us per bucket (goal <= {GOALS['us_per_bucket']:g})"] = (
            extra_us / ours["buckets"])
        if ours["buckets"] > 1:
            goals.append(goal(f"{label}: overlap_ddp us per bucket", extra_us / ours["buckets"],
                              at_most=GOALS["us_per_bucket"], judged=not quick))
        ratios[f"{label}: of which a Python comm hook, us per bucket"] = (
            hook_us / ours["buckets"])
        ratios[f"{label}: of which stepping during backward, us per bucket"] = (
            (extra_us - hook_us) / ours["buckets"])
    return variants, ratios, goals


def run_benchmark(*, rounds: int = 5, world_size: int = 2, quick: bool = False,
                  **options: Any) -> dict[str, Any]:
    """Run the benchmark at 1 rank and at ``world_size`` ranks; return a
    JSON-serialisable dict of medians, ratios and per-bucket costs.

    :param rounds: interleaved rounds (each variant runs ``steps`` timed steps per round).
    :param quick: shallow models and few steps, to check that it runs.
    :param options: ``models`` (names from :data:`MODELS`), ``steps``, ``warmup``.
    """
    models = list(options.get("models", MODELS))
    steps = int(options.get("steps", 3 if quick else 10))
    # the full run warms up past the CPU stepper's choice of order (inline_schedule)
    warmup = int(options.get("warmup", 2 if quick else max(3, SETTLED)))
    if quick:
        rounds = min(rounds, 2)
    variants: dict[str, dict[str, float]] = {}
    ratios: dict[str, float] = {}
    goals: list[dict[str, Any]] = []
    for ranks in sorted({1, world_size}):
        per_rank = run_distributed(_timing_rank, ranks,
                                   args=(models, rounds, steps, warmup, quick), timeout=1200)
        rank_variants, rank_ratios, rank_goals = _figures(ranks, per_rank, rounds, models,
                                                               quick)
        variants.update(rank_variants)
        ratios.update(rank_ratios)
        goals += rank_goals
    described = "; ".join(f"{name} = {MODELS[name].description}" for name in models)
    return {
        "benchmark": "engine_overhead",
        "command": COMMAND + (" --quick" if quick else ""),
        "variants": variants,
        "ratios": ratios,
        "goals": goals,
        "notes": (
            f"1 and {world_size} gloo ranks on CPU, 1 thread each; Adam lr={LR}, batch "
            f"{BATCH}; step = forward + backward + step + zero_grad; median of {rounds} "
            f"interleaved rounds of {steps} steps after {warmup} warm-up steps (slowest "
            f"rank; cpu_ms: the training thread's CPU time, busiest rank). {described}"
            f"{' (quick: shallower)' if quick else ''}; module_plain and "
            "optimizer_in_backward train the 1_bucket model without DDP; plain_comm_hook "
            "is plain DDP with overlapkit's allreduce comm hook registered. Engine cost "
            "per bucket / parameter = (ours - plain) / count, 1 rank; the comm hook's "
            "share = (plain_comm_hook - plain) / count. Goals: ours / plain "
            f"<= {GOALS['ratio_1_rank']} (1 rank), <= {GOALS['ratio_2_ranks']} (2 ranks), "
            f"<= {GOALS['us_per_bucket']:g} us per bucket; optimizer_in_backward <= "
            f"{GOALS['module_ratio']} x plain."
        ),
    }
