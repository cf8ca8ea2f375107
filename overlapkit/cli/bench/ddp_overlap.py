"""Benchmark: overlap_ddp (both step threads) vs torch's ``DDP._register_fused_optim`` vs plain
DDP + step().

Same model, same initial weights, same data, in the same spawned run; the variants
take turns in every round (the order rotates), and each round's figure is the median
step time (forward + backward + step + zero_grad) over its timed steps; the result is
the median over rounds, slowest rank. Peak RSS is measured in a fresh run per variant
(the peak, ``VmHWM``, only grows, so variants sharing a process would share it).

Two models: ``mlp`` (a few large parameters, several buckets) and ``many_small``
(hundreds of small parameters, where torch's per-parameter ``step_param`` pays per
call). Optimizer: Adam, the one all three variants support.

``compute_only`` is the limit no overlap can beat: forward and backward of the same
module without DDP, communication or optimizer. With ``device="cuda"`` (``overlapkit
bench --device cuda``) every rank trains on its own GPU over NCCL, each step timed
between ``torch.cuda.synchronize()`` calls: the figures that tell whether overlap pays
(on CPU the optimizer and backward share the cores, so it cannot).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from overlapkit.cli.bench import goal, torchscript_warnings_silenced
from overlapkit.cli.bench.timing import mlp, slowest_per_round, timed_rounds
from overlapkit.cli.memory import peak_rss_mib
from overlapkit.distributed import run_distributed
from overlapkit.overlap.ddp.inline_schedule import SETTLED

__all__ = ["MODELS", "VARIANTS", "run_benchmark"]

VARIANTS = ("overlapkit", "overlapkit_comm_thread", "torch_fused", "plain", "compute_only")
#: where the ranks train: ``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per rank)
DEVICES = ("cpu", "cuda")
COMMAND = "python benchmarks/ddp_overlap.py"
LR = 1e-3

#: model name -> (input/width, depth, quick depth, DDP bucket_cap_mb)
MODELS: dict[str, tuple[int, int, int, float]] = {
    "mlp": (1024, 6, 3, 1.0),
    "many_small": (16, 200, 60, 25.0),
}


def _build(model_name: str, quick: bool) -> tuple[nn.Module, int, float]:
    """An MLP of ``depth`` Linear(width, width) + Tanh layers, the same on every call."""
    width, depth, quick_depth, cap = MODELS[model_name]
    if quick:
        width, depth = min(width, 256), quick_depth
    return mlp(width, depth), width, cap


class _Variant:
    """One variant's model (DDP but for ``compute_only``) and a ``train_step(x)``."""

    def __init__(self, name: str, model_name: str, quick: bool, device: str = "cpu") -> None:
        import overlapkit

        model, self.features, cap = _build(model_name, quick)
        self.device = torch.device(device, dist.get_rank()) if device == "cuda" else None
        if self.device is not None:
            model = model.to(self.device)
        self.optimizer: Any = None
        if name == "compute_only":
            self.ddp: Any = model  # no DDP: no communication, no step
            return
        self.ddp = DDP(model, bucket_cap_mb=cap,
                       device_ids=None if self.device is None else [self.device.index])
        if name.startswith("overlapkit"):
            thread = "comm" if name.endswith("comm_thread") else "backward"
            self.optimizer = overlapkit.overlap_ddp(self.ddp, torch.optim.Adam, lr=LR,
                                                    step_thread=thread)
        elif name == "torch_fused":
            with torchscript_warnings_silenced():  # torch warns on every construction
                self.ddp._register_fused_optim(torch.optim.Adam, lr=LR)
        else:
            self.optimizer = torch.optim.Adam(self.ddp.parameters(), lr=LR)

    def train_step(self, x: torch.Tensor) -> None:
        if self.device is not None:
            torch.cuda.synchronize(self.device)  # time the step, not what came before
        self.ddp(x).square().mean().backward()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad()
        else:
            self.ddp.zero_grad(set_to_none=True)
        if self.device is not None:
            torch.cuda.synchronize(self.device)


def _timing_rank(rank: int, world_size: int, model_name: str, rounds: int, steps: int,
                 warmup: int, quick: bool, device: str = "cpu") -> dict[str, list[float]]:
    variants = {name: _Variant(name, model_name, quick, device) for name in VARIANTS}
    features = variants["plain"].features
    generator = torch.Generator().manual_seed(rank)
    batch = torch.randn(32, features, generator=generator)
    if device == "cuda":
        batch = batch.to(torch.device("cuda", rank))
    for variant in variants.values():
        for _ in range(warmup):
            variant.train_step(batch)
    per_round = timed_rounds(variants, VARIANTS, rounds, steps, batch)
    return per_round


def _memory_rank(rank: int, world_size: int, variant_name: str, model_name: str,
                 steps: int, quick: bool, device: str = "cpu") -> dict[str, float]:
    baseline = peak_rss_mib()
    variant = _Variant(variant_name, model_name, quick, device)
    batch = torch.randn(32, variant.features)
    if variant.device is not None:
        batch = batch.to(variant.device)
        torch.cuda.reset_peak_memory_stats(variant.device)
    for _ in range(steps):
        variant.train_step(batch)
    peak = peak_rss_mib()
    figures = {"peak_rss_mib": peak, "peak_rss_above_baseline_mib": peak - baseline}
    if variant.device is not None:
        figures["peak_cuda_mib"] = torch.cuda.max_memory_allocated(variant.device) / 2**20
    return figures


def run_benchmark(*, rounds: int = 5, world_size: int = 2, quick: bool = False,
                  **options: Any) -> dict[str, Any]:
    """Run the benchmark; return a JSON-serialisable dict of medians and ratios.

    :param rounds: interleaved rounds (each variant runs ``steps`` timed steps per round).
    :param quick: small models and few steps, to check that it runs.
    :param options: ``models`` (names from :data:`MODELS`), ``steps``, ``warmup``,
        ``device`` (``"cpu"``, or ``"cuda"``: NCCL, one GPU per rank).
    """
    device = str(options.get("device", "cpu"))
    backend = "nccl" if device == "cuda" else "gloo"
    # quick: one model, so `overlapkit bench --quick` stays a smoke test of every variant
    models = list(options.get("models", ["mlp"] if quick else MODELS))
    steps = int(options.get("steps", 5 if quick else 20))
    # the full run warms up past the CPU stepper's choice of order (inline_schedule)
    warmup = int(options.get("warmup", 2 if quick else max(5, SETTLED)))
    if quick:
        rounds = min(rounds, 2)
    variants: dict[str, dict[str, float]] = {}
    ratios: dict[str, float] = {}
    goals = []
    for model_name in models:
        per_rank = run_distributed(
            _timing_rank, world_size,
            args=(model_name, rounds, steps, warmup, quick, device), timeout=600,
            backend=backend,
        )
        for name in VARIANTS:
            # the slowest rank's median per round, then the median over rounds
            slowest = slowest_per_round(per_rank, name)
            memory = run_distributed(_memory_rank, world_size,
                                     args=(name, model_name, warmup + steps, quick, device),
                                     backend=backend)
            variants[f"{model_name}/{name}"] = {"step_ms": 1000 * statistics.median(slowest)}
            for key in memory[0]:  # RSS; on a GPU also its peak allocated memory
                variants[f"{model_name}/{name}"][key] = max(m[key] for m in memory)
        ours = variants[f"{model_name}/overlapkit"]["step_ms"]
        ratios[f"{model_name}: overlapkit / torch_fused step time"] = (
            ours / variants[f"{model_name}/torch_fused"]["step_ms"])
        ratios[f"{model_name}: overlapkit / plain step time"] = (
            ours / variants[f"{model_name}/plain"]["step_ms"])
        ratios[f"{model_name}: overlapkit / compute_only step time"] = (
            ours / variants[f"{model_name}/compute_only"]["step_ms"])
        ratios[f"{model_name}: plain / compute_only step time"] = (
            variants[f"{model_name}/plain"]["step_ms"]
            / variants[f"{model_name}/compute_only"]["step_ms"])
        goals += [goal(f"{model_name}: overlapkit / torch_fused step time",
                       ratios[f"{model_name}: overlapkit / torch_fused step time"],
                       at_most=0.95, judged=not quick),
                  goal(f"{model_name}: overlapkit / plain step time",
                       ratios[f"{model_name}: overlapkit / plain step time"], at_most=1.0,
                       judged=not quick)]
    return {
        "benchmark": "overlap_ddp",
        "command": COMMAND + (" --quick" if quick else ""),
        "variants": variants,
        "ratios": ratios,
        "goals": goals,
        "notes": (
            f"{world_size} "
            + ("NCCL ranks, one GPU each" if device == "cuda" else "gloo ranks on CPU")
            + f", Adam lr={LR}, batch 32; step = forward + backward + step + zero_grad "
            "(compute_only: forward + backward of the module alone, no DDP, no step: "
            f"the limit); median of {rounds} interleaved rounds of {steps} steps after "
            f"{warmup} warm-up steps "
            "(slowest rank); peak memory from a fresh run per variant."
        ),
    }
