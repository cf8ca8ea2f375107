"""Benchmark: steps that wait for a global decision (issue 12) — a ``GradScaler`` and
global norm clipping — under ``overlap_ddp`` and ``optimizer_in_backward`` vs plain
DDP doing the same thing, and the no-scaler, no-clipping path for reference.

Same model (the ``mlp`` of the ddp_overlap benchmark: several buckets), same initial
weights, same data, in the same spawned run; the variants take turns in every round
(the order rotates), each round's figure is the median step time (forward + backward
+ step + update + zero_grad) over its timed steps, the result the median over rounds,
slowest rank. The AMP variants run the PyTorch loop ``scaler.scale(loss).backward();
scaler.step(opt); scaler.update()`` on fp32 parameters with
``torch.amp.GradScaler("cpu")`` (what is measured is the scaler's cost: unscale, inf
check, the cross-rank skip decision, not fp16 kernels, which CPUs lack); the clipping
variants clip to a norm the gradients exceed, so the clipping is active.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from overlapkit.cli.bench import goal
from overlapkit.cli.bench.timing import mlp, slowest_per_round, timed_rounds
from overlapkit.distributed import run_distributed

__all__ = ["VARIANTS", "run_benchmark"]

#: variant -> (technique or "plain", with a GradScaler, clipping scope or None)
VARIANTS: dict[str, tuple[str, bool, str | None]] = {
    "plain": ("plain", False, None),
    "overlap_ddp": ("overlap_ddp", False, None),
    "plain_amp": ("plain", True, None),
    "overlap_ddp_amp": ("overlap_ddp", True, None),
    "optimizer_in_backward_amp": ("optimizer_in_backward", True, None),
    "plain_clip": ("plain", False, "global"),
    "overlap_ddp_clip": ("overlap_ddp", False, "global"),
    "optimizer_in_backward_clip": ("optimizer_in_backward", False, "global"),
    "overlap_ddp_clip_bucket": ("overlap_ddp", False, "bucket"),
}
COMMAND = "python benchmarks/mixed_precision.py"
LR = 1e-3
MAX_NORM = 1e-3  # below the gradients' norm: clipping is active at every step
#: (width, depth, quick depth, DDP bucket_cap_mb): the ddp_overlap benchmark's ``mlp``
MODEL = (1024, 6, 3, 1.0)


def _build(quick: bool) -> tuple[torch.nn.Module, int, float]:
    """The ddp_overlap benchmark's ``mlp`` (several buckets), the same on every call."""
    width, depth, quick_depth, cap = MODEL
    if quick:
        width, depth = min(width, 256), quick_depth
    return mlp(width, depth), width, cap


class _Variant:
    """One variant's DDP model, optimizer, scaler and a ``train_step(x)``."""

    def __init__(self, name: str, quick: bool) -> None:
        import overlapkit

        technique, amp, scope = VARIANTS[name]
        model, self.features, cap = _build(quick)
        self.ddp = DDP(model, bucket_cap_mb=cap)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if amp else None
        self.clip = scope is not None and technique == "plain"
        if technique == "plain":
            self.optimizer: Any = torch.optim.AdamW(self.ddp.parameters(), lr=LR)
            return
        options: dict[str, Any] = {"lr": LR, "grad_scaler": self.scaler}
        if scope is not None:
            options.update(clip_grad_norm=MAX_NORM, clip_grad_norm_scope=scope)
        self.optimizer = getattr(overlapkit, technique)(self.ddp, torch.optim.AdamW,
                                                        **options)

    def train_step(self, x: torch.Tensor) -> None:
        loss = self.ddp(x).square().mean()
        scaler = self.scaler
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(self.optimizer)
            scaler.update()
        else:
            loss.backward()
            if self.clip:
                torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), MAX_NORM)
            self.optimizer.step()
        self.optimizer.zero_grad()


def _timing_rank(rank: int, world_size: int, rounds: int, steps: int, warmup: int,
                 quick: bool) -> dict[str, list[float]]:
    names = tuple(VARIANTS)
    variants = {name: _Variant(name, quick) for name in names}
    generator = torch.Generator().manual_seed(rank)
    batch = torch.randn(32, variants["plain"].features, generator=generator)
    for variant in variants.values():
        for _ in range(warmup):
            variant.train_step(batch)
    per_round = timed_rounds(variants, names, rounds, steps, batch)
    return per_round


def run_benchmark(*, rounds: int = 5, world_size: int = 2, quick: bool = False,
                  **options: Any) -> dict[str, Any]:
    """Run the benchmark; return a JSON-serialisable dict of medians and ratios.

    :param rounds: interleaved rounds (each variant runs ``steps`` timed steps per round).
    :param quick: a small model and few steps, to check that it runs.
    :param options: ``steps``, ``warmup``.
    """
    steps = int(options.get("steps", 5 if quick else 20))
    warmup = int(options.get("warmup", 2 if quick else 5))
    if quick:
        rounds = min(rounds, 2)
    per_rank = run_distributed(_timing_rank, world_size,
                               args=(rounds, steps, warmup, quick), timeout=600)
    variants: dict[str, dict[str, float]] = {}
    for name in VARIANTS:
        slowest = slowest_per_round(per_rank, name)
        variants[name] = {"step_ms": 1000 * statistics.median(slowest)}
    ms = {name: figures["step_ms"] for name, figures in variants.items()}
    ratios = {
        "overlap_ddp / plain step time (no scaler, no clipping)":
            ms["overlap_ddp"] / ms["plain"],
        "overlap_ddp + GradScaler / plain DDP + GradScaler":
            ms["overlap_ddp_amp"] / ms["plain_amp"],
        "optimizer_in_backward + GradScaler / plain DDP + GradScaler":
            ms["optimizer_in_backward_amp"] / ms["plain_amp"],
        "overlap_ddp global clipping / plain DDP + clip_grad_norm_":
            ms["overlap_ddp_clip"] / ms["plain_clip"],
        "optimizer_in_backward global clipping / plain DDP + clip_grad_norm_":
            ms["optimizer_in_backward_clip"] / ms["plain_clip"],
        "overlap_ddp bucket clipping / plain DDP + clip_grad_norm_":
            ms["overlap_ddp_clip_bucket"] / ms["plain_clip"],
    }
    # With a scaler or global clipping the step waits for the end of backward: the goal
    # is to cost no more than plain DDP doing the same, within this machine's noise.
    waiting = [name for name in ratios if "GradScaler" in name or "global clipping" in name]
    return {
        "benchmark": "mixed_precision",
        "command": COMMAND + (" --quick" if quick else ""),
        "variants": variants,
        "ratios": ratios,
        "goals": [goal(name, ratios[name], at_most=1.1, judged=not quick)
                  for name in waiting],
        "notes": (
            f"{world_size} gloo ranks on CPU, AdamW lr={LR}, batch 32, the ddp_overlap "
            "mlp; step = forward + backward + step (+ scaler.update) + zero_grad; "
            f"GradScaler('cpu') on fp32 parameters; clipping to {MAX_NORM} (active); "
            f"median of {rounds} interleaved rounds of {steps} steps (slowest rank). "
            "With a scaler or global clipping the steps wait for the end of backward "
            "(the allreduces still overlap it): expect ~1.0x plain, not the overlap gain."
        ),
    }
