"""What the benchmarks share to build and time their variants: the MLP they train, and
interleaved timing rounds on every rank.

Every variant of a benchmark trains the same model (:func:`mlp`, seeded); step times are
taken in rounds that run each variant in turn, the order rotating from round to round
(:func:`rotated`), so that load from other processes falls on every variant alike; a
round's figure is a variant's median step (:func:`timed_rounds`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TrainsOneStep", "mlp", "paired_ratio", "rotated", "slowest_per_round",
           "timed_rounds"]


def mlp(width: int, depth: int) -> nn.Module:
    """``depth`` x (``Linear(width, width)``, ``Tanh``), the same weights on every call."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` in the order of round ``round_index``: each round starts one later."""
    shift = round_index % len(names) if names else 0
    return [*names[shift:], *names[:shift]]


class TrainsOneStep(Protocol):
    def train_step(self, batch: Any) -> Any: ...


def timed_rounds(variants: Mapping[str, TrainsOneStep], names: Sequence[str], rounds: int,
                 steps: int, batch: Any) -> dict[str, list[float]]:
    """Per variant, its median step time (s) in each of ``rounds`` rotating rounds of
    ``steps`` steps; the ranks meet at a barrier before each step, so a step's time is
    the same step on every rank. Call on every rank."""
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in rotated(names, round_index):
            times = []
            for _ in range(steps):
                dist.barrier()
                started = time.perf_counter()
                variants[name].train_step(batch)
                times.append(time.perf_counter() - started)
            per_round[name].append(statistics.median(times))
    return per_round


def paired_ratio(ours: list[float], other: list[float]) -> float:
    """The median over rounds of ``ours / other`` within each round: the two ran seconds
    apart, so load from other processes cancels better than in a ratio of medians."""
    return statistics.median(a / b for a, b in zip(ours, other, strict=True))


def slowest_per_round(per_rank: Sequence[Mapping[str, Sequence[float]]], name: str
                      ) -> list[float]:
    """The slowest rank's figure for ``name`` in each round, from what each rank's
    :func:`timed_rounds` returned: a step is as slow as its slowest rank."""
    rounds = len(per_rank[0][name])
    return [max(r[name][i] for r in per_rank) for i in range(rounds)]
