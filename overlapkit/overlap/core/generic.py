"""The generic overlapped optimizer engine: any ``torch.optim`` optimizer, one subset
of parameters at a time.

Registered (by :mod:`overlapkit.overlap.plugin`) for ``torch.optim.Optimizer``, so it
serves every optimizer class that no plugin serves more specifically. It steps a subset
of parameters with the real optimizer's own ``step()``, which is why any ``torch.optim``
optimizer works and why the result is bitwise the plain optimizer's (measured on torch
2.13 for every dense ``torch.optim`` optimizer, see ``tests/test_ddp_overlap.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import is_

import torch

from overlapkit.overlap.core.direct_step import step_optimizer
from overlapkit.overlap.core.engine import OverlapEngine, ParamGroup, StepPlan
from overlapkit.overlap.core.functional_step import FunctionalSteps
from overlapkit.overlap.core.part_steps import check_steps_per_part

__all__ = ["GenericOverlapEngine"]


class GenericOverlapEngine(OverlapEngine):
    """Steps a subset of parameters by running the real optimizer's ``step()`` with
    its ``param_groups`` swapped, for the duration of the call, for copies that hold
    only the subset.

    During the call ``optimizer.param_groups`` *is* the list of copies (the attribute
    is rebound, then restored), so read ``param_groups`` from another thread only
    while holding the engine's ``lock``. The copies are made at step time, so an LR
    scheduler's latest ``lr`` is the one used; a value the optimizer writes into its
    group during ``step()`` (D-Adaptation's or Prodigy's ``d``, for example) is
    copied back into the live group afterwards. Per-parameter state is keyed by the
    parameter, so it is shared with full steps and ``state_dict()``.

    Optimizer step hooks (``register_step_pre_hook``) run once per subset stepped.
    Without any hook (and no profiler running) ``step()`` is called past torch's
    hook-and-profiler wrapper (:mod:`overlapkit.overlap.core.direct_step`), and ``Adam``,
    ``AdamW`` and ``SGD`` run ``step()``'s own loop body on the subset directly, with
    each subset's tensor lists kept from one step to the next
    (:mod:`overlapkit.overlap.core.functional_step`): the same kernels, less Python.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        check_steps_per_part(optimizer)  # before anything is set up: may refuse it
        self._functional = FunctionalSteps(optimizer)  # before reindex() runs
        super().__init__(optimizer)

    def reindex(self) -> None:
        with self.lock:
            super().reindex()
            self._functional.forget()

    def step_planned(self, plan: StepPlan,
                     groups: Sequence[tuple[ParamGroup, list[torch.Tensor]]]) -> None:
        if not self._functional.step(groups, plan):
            self._step_through_step(groups)

    def step_groups(self, groups: Sequence[tuple[ParamGroup, list[torch.Tensor]]]) -> None:
        if not self._functional.step(groups):
            self._step_through_step(groups)

    def _step_through_step(self,
                           groups: Sequence[tuple[ParamGroup, list[torch.Tensor]]]) -> None:
        optimizer = self.optimizer
        live = optimizer.param_groups
        before: list[ParamGroup] = []
        subset: list[ParamGroup] = []
        for group, params in groups:
            values = dict(group)
            values["params"] = params
            before.append(values)
            subset.append(dict(values))
        optimizer.param_groups = subset
        try:
            step_optimizer(optimizer)
        finally:
            optimizer.param_groups = live
        for (group, _), values, copy in zip(groups, before, subset, strict=True):
            # the usual case, checked in C: step() wrote nothing into the group
            if len(copy) == len(values) and all(map(is_, copy.values(), values.values())):
                continue
            # only what step() itself wrote: not a value set on the live group meanwhile
            for key, value in copy.items():
                if key != "params" and (key not in values or values[key] is not value):
                    group[key] = value
