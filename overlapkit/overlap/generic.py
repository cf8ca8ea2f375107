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

import torch

from overlapkit.overlap.engine import OverlapEngine, ParamGroup

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
    """

    def step_groups(self, groups: Sequence[tuple[ParamGroup, list[torch.Tensor]]]) -> None:
        optimizer = self.optimizer
        live = optimizer.param_groups
        before = [dict(group) for group, _ in groups]
        subset = []
        for values, (_, params) in zip(before, groups, strict=True):
            copy = dict(values)
            copy["params"] = params
            subset.append(copy)
        optimizer.param_groups = subset
        try:
            optimizer.step()
        finally:
            optimizer.param_groups = live
        # only what step() itself wrote: not a value set on the live group meanwhile
        for (group, _), values, copy in zip(groups, before, subset, strict=True):
            for key, value in copy.items():
                if key != "params" and (key not in values or values[key] is not value):
                    group[key] = value
