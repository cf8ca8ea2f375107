"""Built-in plugin ``overlapkit.ddp_overlap``: the generic overlapped optimizer.

Registered for ``torch.optim.Optimizer``, so it serves every optimizer class that no
plugin serves more specifically. It steps a subset of parameters with the real
optimizer's own ``step()``, which is why any ``torch.optim`` optimizer works and why
the result is bitwise the plain optimizer's (measured on torch 2.13 for every dense
``torch.optim`` optimizer, see ``tests/test_ddp_overlap.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from overlapkit.hookspecs import hookimpl
from overlapkit.overlapped import OverlappedOptimizer, ParamGroup
from overlapkit.records import OptimizerSpec

__all__ = ["GenericOverlappedOptimizer", "overlapkit_register_optimizers"]


class GenericOverlappedOptimizer(OverlappedOptimizer):
    """Steps a subset of parameters by running the real optimizer's ``step()`` with
    its ``param_groups`` swapped, for the duration of the call, for copies that hold
    only the subset.

    The live group dicts are never edited, so a thread reading ``param_groups``
    while a bucket steps sees them whole; the copies are made at step time, so an
    LR scheduler's latest ``lr`` is the one used. Per-parameter state is keyed by the
    parameter, so it is shared with full steps and ``state_dict()``.

    Optimizer step hooks (``register_step_pre_hook``) run once per subset stepped.
    """

    def step_groups(self, groups: Sequence[tuple[ParamGroup, list[torch.Tensor]]]) -> None:
        optimizer = self.optimizer
        live = optimizer.param_groups
        subset = []
        for group, params in groups:
            copy = dict(group)
            copy["params"] = params
            subset.append(copy)
        optimizer.param_groups = subset
        try:
            optimizer.step()
        finally:
            optimizer.param_groups = live


@hookimpl
def overlapkit_register_optimizers() -> OptimizerSpec:
    return OptimizerSpec(
        optim_cls=torch.optim.Optimizer,
        overlapped_cls=GenericOverlappedOptimizer,
        description="any torch.optim optimizer, stepped one bucket at a time",
    )
