"""What keeping each subset's tensor lists saves: one step of Adam, in thread CPU time.

One process, no process group: ``n`` parameters of ``size`` floats with gradients set,
stepped (a) by the plain ``Adam.step()``, (b) by the engine's functional path with the
lists worked out by ``_init_group`` at every call (overlapkit up to this change:
``step_functionally`` with nothing kept), (c) the engine's ``step_plan`` of each
subset's kept plan, whose lists are kept and checked
(:class:`overlapkit.overlap.core.functional_step.FunctionalSteps`; its lock and plan
check included). Each in
one call over every parameter (one rank at the end of backward) and in one call per
parameter (a bucket per parameter, as on a side stream), ``foreach`` False (the CPU
default) and True (the multi-tensor implementation, CUDA's default). Medians of 5
rounds of 200 steps, in us per step.

    PYTHONPATH=$PWD python benchmarks/tensor_lists.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from overlapkit.overlap.core.functional_step import step_functionally
from overlapkit.overlap.core.generic import GenericOverlapEngine

ROUNDS, STEPS, WARM_UP = 5, 200, 10


def _stepper(count: int, size: int, foreach: bool, per_parameter: bool,
             variant: str) -> Callable[[], None]:
    torch.manual_seed(0)
    params: list[torch.Tensor] = [nn.Parameter(torch.randn(size)) for _ in range(count)]
    for param in params:
        param.grad = torch.randn(size)
    optimizer = torch.optim.Adam(params, lr=1e-3, foreach=foreach)
    group = optimizer.param_groups[0]
    subsets = [[param] for param in params] if per_parameter else [params]
    engine = GenericOverlapEngine(optimizer)
    plans = [engine.plan(subset) for subset in subsets]

    def step() -> None:
        if variant == "plain step()":
            optimizer.step()
            return
        if variant == "lists kept":
            for plan in plans:
                engine.step_plan(plan)
            return
        for subset in subsets:
            step_functionally(optimizer, [(group, subset)])

    return step


def median_us(step: Callable[[], None]) -> float:
    for _ in range(WARM_UP):
        step()
    rounds = []
    for _ in range(ROUNDS):
        start = time.thread_time()
        for _ in range(STEPS):
            step()
        rounds.append((time.thread_time() - start) / STEPS * 1e6)
    return statistics.median(rounds)


def main() -> None:
    torch.set_num_threads(1)
    variants = ("plain step()", "_init_group each call", "lists kept")
    print("| foreach | calls | parameters | " + " | ".join(f"{v} us" for v in variants)
          + " | kept / _init_group |")
    print("|---|---|---|" + "---:|" * (len(variants) + 1))
    for foreach in (False, True):
        for per_parameter in (False, True):
            for count, size in ((100, 256), (400, 16)):
                figures = [median_us(_stepper(count, size, foreach, per_parameter, v))
                           for v in variants]
                calls = "one per parameter" if per_parameter else "one"
                print(f"| {foreach} | {calls} | {count} x {size} | "
                      + " | ".join(f"{f:.0f}" for f in figures)
                      + f" | {figures[2] / figures[1]:.2f} |")


if __name__ == "__main__":
    main()
