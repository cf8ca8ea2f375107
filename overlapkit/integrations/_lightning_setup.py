"""The set-up of overlapkit's Lightning strategies, once per fit, before the first step:
what cannot be honoured is refused here, and the optimizer that ``configure_optimizers``
returned is adopted by an overlapped one on the model Lightning has just wrapped.

Private to :mod:`overlapkit.integrations.lightning`, which checks that Lightning is
installed before importing this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from overlapkit.errors import ConfigurationError
from overlapkit.optimizer_wrapper import OptimizerWrapper
from overlapkit.overlap.core.step_hooks import instance_override
from overlapkit.overlap.facade import OverlappedOptimizerFacade

__all__ = ["TECHNIQUES", "check_fit", "clipping_of", "overlapped_like", "plain_optimizer",
           "step_patch_refusal"]

#: what the strategies step with
TECHNIQUES = ("overlap_ddp", "optimizer_in_backward")
#: the precisions whose optimizer step is the plain ``optimizer.step(closure)``, tested
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed")


def check_fit(module: pl.LightningModule, precision: Precision, strategy: str,
              technique: str) -> None:
    """Refuse what Lightning would do after backward, where the overlapped optimizer has
    already stepped.

    :raises ConfigurationError: manual optimization, a precision other than
        ``SUPPORTED_PRECISIONS``.
    """
    name = type(module).__name__
    if not module.automatic_optimization:
        raise ConfigurationError(
            f"{strategy} drives Lightning's automatic optimization, and {name} sets "
            "automatic_optimization = False. With manual optimization training_step steps "
            f"the optimizers itself, while {technique} steps an optimizer during the "
            "backward that produces its gradients (with several optimizers, one backward "
            "would step all of them at once). Return the loss from training_step and let "
            "Lightning optimize, or train this module with strategy='ddp' (or the default "
            "single-device strategy)."
        )
    kind = getattr(precision, "precision", type(precision).__name__)
    if type(precision) is Precision or (
            type(precision) is MixedPrecision and precision.scaler is None):
        return
    reason = ("uses a GradScaler, whose unscale and inf check Lightning runs after backward"
              if isinstance(precision, MixedPrecision) and precision.scaler is not None
              else f"steps through {type(precision).__name__}, whose optimizer step "
              f"{strategy} does not replace")
    raise ConfigurationError(
        f"precision={kind!r} {reason}, where {technique} has already stepped. {strategy} "
        f"supports precision={' and '.join(map(repr, SUPPORTED_PRECISIONS))}; use one of "
        "them, or strategy='ddp' for this precision."
    )


def plain_optimizer(optimizers: Sequence[Any], strategy: str) -> torch.optim.Optimizer:
    """The one plain ``torch.optim.Optimizer`` that ``configure_optimizers`` returned.

    :raises ConfigurationError: none, an overlapkit optimizer, something that is not a
        torch optimizer, or an optimizer with step hooks (they would run once per
        bucket or parameter).
    """
    if len(optimizers) != 1:  # Lightning refuses several under automatic optimization
        raise ConfigurationError(
            f"configure_optimizers returned {len(optimizers)} optimizers; {strategy} steps "
            "one during backward (a DDP model takes one comm hook): return one."
        )
    (optimizer,) = optimizers
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    if isinstance(optimizer, OptimizerWrapper):
        raise ConfigurationError(
            f"configure_optimizers returned an overlapkit optimizer "
            f"({type(optimizer).__name__}); return the plain one, e.g. "
            f"torch.optim.AdamW(self.parameters(), lr=...): {strategy} builds the "
            "overlapped optimizer from it, on the model Lightning wraps after "
            "configure_optimizers."
        )
    if type(optimizer).__name__ == "_MockOptimizer" or not isinstance(
            optimizer, torch.optim.Optimizer):
        raise ConfigurationError(
            f"configure_optimizers returned {type(optimizer).__name__}, not a "
            f"torch.optim.Optimizer, so {strategy} has nothing to step during backward; "
            "return the optimizer (and its LR scheduler) as for the plain Trainer."
        )
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        raise ConfigurationError(
            f"the {type(optimizer).__name__} from configure_optimizers has step hooks, "
            "which would run once per bucket or parameter stepped during backward; "
            "remove them (log or adjust in on_train_batch_end instead)."
        )
    return optimizer


def clipping_of(trainer: pl.Trainer) -> dict[str, float]:
    """Lightning's ``gradient_clip_val`` / ``gradient_clip_algorithm`` as the clipping
    arguments of ``overlap_ddp`` / ``optimizer_in_backward``: what Lightning's precision
    plugin clips after backward (``clip_grad_norm_`` with the 2-norm, or
    ``clip_grad_value_``; nothing for None or a value <= 0)."""
    value = trainer.gradient_clip_val
    if value is None or value <= 0:
        return {}
    if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        return {"clip_grad_value": float(value)}
    return {"clip_grad_norm": float(value)}


def overlapped_like(plain: torch.optim.Optimizer, technique: str, model: torch.nn.Module,
                    clipping: Mapping[str, float], options: Mapping[str, Any]
                    ) -> OverlappedOptimizerFacade:
    """``overlap_ddp`` / ``optimizer_in_backward`` of ``model`` stepping ``plain``
    itself (adopted: its param groups, ``initial_lr`` of a scheduler, defaults and state
    stay, and a ``self.optimizer`` the module kept from ``configure_optimizers`` stays
    live); clipping by global norm in ``plain``'s parameter order, as Lightning's
    precision plugin clips (``main_params``: group by group)."""
    from overlapkit.overlap.adopt import check_adopted
    from overlapkit.overlap.techniques import optimizer_in_backward, overlap_ddp

    build: Callable[..., OverlappedOptimizerFacade] = (
        overlap_ddp if technique == "overlap_ddp" else optimizer_in_backward)
    overlapped = build(model, plain, **options, **clipping)
    check_adopted(overlapped.optimizer, plain)
    overlapped.clip_in_order(p for group in plain.param_groups for p in group["params"])
    return overlapped


def step_patch_refusal(optimizer: Any, strategy: str, technique: str
                       ) -> ConfigurationError | None:
    """The error for a ``step`` set on the instance of the optimizer Lightning steps
    (``self.trainer.optimizers[0].step = wrapper``, installed in ``on_train_start``),
    asked as each optimizer step begins, before its closure runs: Lightning's plain loop
    hands that wrapper its closure (``training_step`` and the backward), so the wrapper's
    code after it (a ``.grad`` edit, a second closure as SAM runs) works in the window,
    where overlapkit's strategies run the closure first and call ``step()`` after the
    backward stepped. Before (the eleventh probe), a wrapper halving the gradients after
    the closure was silently 0.028 off the plain fit. None when there is no such patch
    (torch's LR-scheduler wrapper is seen through)."""
    patch = (instance_override(optimizer) if isinstance(optimizer, torch.optim.Optimizer)
             else None)
    if patch is None:
        return None
    return ConfigurationError(
        f"{patch}: Lightning's plain loop calls it with its closure (training_step and the "
        f"backward), so its code after that closure works between backward and step, "
        f"where {strategy} ({technique}) steps during the closure's backward. Nothing was "
        "stepped in this step. Work there in an optimizer_step override of the "
        "LightningModule (optimizer.step(closure=...) with a closure of your own: taken "
        "in the plain order), or train with strategy='ddp'."
    )
