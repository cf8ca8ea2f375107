"""Lion's overlapped step: a whole gradient bucket in a few multi-tensor kernels.

overlapkit's generic engine steps a bucket by pointing the real optimizer's
``param_groups`` at the bucket's parameters and calling ``step()``: correct for every
optimizer, but it pays ``step()``'s per-call overhead (group bookkeeping, state
look-ups) once per bucket. Lion's update is element-wise, so this class calls
:func:`~overlapkit_lion.optimizer.lion_update` on the bucket's parameters directly, with
the same arithmetic as :meth:`Lion.step` and therefore the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from overlapkit import OverlappedOptimizer, UnsupportedOptimizerError
from overlapkit.overlapped import ParamGroup
from overlapkit_lion.optimizer import Lion, lion_update

__all__ = ["LionOverlapped"]


class LionOverlapped(OverlappedOptimizer):
    """Steps buckets of a :class:`~overlapkit_lion.Lion` optimizer with foreach kernels."""

    @classmethod
    def check_supported(cls, optim_cls: type[torch.optim.Optimizer]) -> None:
        super().check_supported(optim_cls)
        if not issubclass(optim_cls, Lion):
            raise UnsupportedOptimizerError(
                f"LionOverlapped steps Lion optimizers only, got {optim_cls.__qualname__}; "
                "register it for overlapkit_lion.Lion (the plugin does)."
            )

    def step_groups(self, groups: Sequence[tuple[ParamGroup, list[torch.Tensor]]]) -> None:
        lion = self.optimizer
        assert isinstance(lion, Lion)
        # Called on DDP's comm-hook thread, where grad mode is on by default.
        with torch.no_grad():
            for group, params in groups:
                with_grad, grads, exp_avgs = lion.group_tensors(group, params)
                beta1, beta2 = group["betas"]
                lion_update(with_grad, grads, exp_avgs, lr=group["lr"], beta1=beta1,
                            beta2=beta2, weight_decay=group["weight_decay"], foreach=True)
