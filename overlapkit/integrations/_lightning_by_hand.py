"""Why a Lightning fit runs a backward outside ``optimizer.step(closure=...)``, in the
words of the one warning (or the refusal) that says so.

Three things run Lightning's backward by hand, and overlapkit's strategies see the same
thing for all three (a synchronised backward outside the optimizer step): an
``optimizer_step`` override calling ``optimizer_closure()`` itself; a ``step`` set on
the instance of ``self.optimizers()`` (Lightning's ``LightningOptimizer``) that runs the
closure and then calls the saved ``step``; and manual optimization switched on after
``trainer.fit()`` set the fit up (``self.automatic_optimization = False`` in
``on_train_start``: set before the fit, it is refused at set-up), whose
``self.manual_backward`` runs in ``training_step``. Before the twelfth probe all three
were warned of as the first ("the optimizer_step override runs the closure itself"),
and the third, under ``optimizer_in_backward`` on DDP, was refused only after
``training_step`` returned, its ``opt.step()`` taken already while the message said
nothing had stepped.

Private to :mod:`overlapkit.integrations.lightning`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from overlapkit.errors import ConfigurationError

__all__ = ["by_hand_warning", "manual_optimization_refusal", "refuse_manual",
           "step_wrapper_of"]


def step_wrapper_of(strategy: pl.strategies.Strategy) -> str | None:
    """``self.optimizers()`` (the ``LightningOptimizer`` the strategy hands the module)
    when a ``step`` is set on that instance, or None. Asked only on the warning's path."""
    for wrapped in getattr(strategy, "_lightning_optimizers", ()) or ():
        if "step" in vars(wrapped):
            return f"{type(wrapped).__name__}.step"
    return None


def by_hand_warning(strategy_name: str, technique: str,
                    strategy: pl.strategies.Strategy | None = None) -> str:
    """The one warning of a fit whose backward runs outside ``optimizer.step(closure=
    ...)``: those steps are taken at ``optimizer.step()``, in the plain order (on DDP;
    on one device the accumulating path). Names what ran it: manual optimization, a
    wrapper on ``self.optimizers().step``, or (else) an ``optimizer_step`` override."""
    module: Any = getattr(strategy, "lightning_module", None)
    tail = ("at optimizer.step(), in the plain order, without overlap: that backward "
            "cannot know whether a step follows or is skipped. Those steps are the plain "
            "Trainer's, bitwise. To keep the overlap: ")
    if module is not None and not module.automatic_optimization:
        return (
            f"{strategy_name} ({technique}) takes the steps of manual optimization "
            f"(automatic_optimization was set to False after trainer.fit() set the fit "
            f"up, e.g. in on_train_start; self.manual_backward(loss) then opt.step() in "
            f"training_step) {tail}leave automatic_optimization on and return the loss "
            "from training_step (set to False before the fit, it is refused).")
    wrapper = step_wrapper_of(strategy) if strategy is not None else None
    if wrapper is not None:
        return (
            f"{strategy_name} ({technique}) takes the steps whose closure the {wrapper} "
            "set on the instance of self.optimizers() runs itself (closure() before "
            f"calling the saved step) {tail}hand the closure to the saved step "
            "(saved_step(closure=closure)) and do the wrapper's own work before it.")
    return (
        f"{strategy_name} ({technique}) takes the steps whose closure the optimizer_step "
        "override runs itself (optimizer_closure() outside optimizer.step(closure=...)) "
        f"{tail}pass the closure, optimizer.step(closure=optimizer_closure), and skip an "
        "update by other means (a zero learning rate)."
    )


def manual_optimization_refusal(strategy_name: str, technique: str) -> ConfigurationError:
    """Manual optimization switched on after the set-up, under ``optimizer_in_backward``
    on DDP (whose early freeing of the gradients DDP has taken loses what a
    ``manual_backward`` accumulates): refused as its first ``manual_backward`` starts,
    before anything is reduced or stepped."""
    return ConfigurationError(
        f"automatic_optimization was set to False after trainer.fit() set the fit up "
        f"(e.g. in on_train_start), and training_step now runs self.manual_backward(...): "
        f"under {strategy_name} ({technique}) on DDP each gradient is freed once DDP has "
        "taken it, so what a manual backward accumulates would be lost where the plain "
        "run keeps it. Nothing was stepped in this step. Leave automatic_optimization on "
        "and return the loss from training_step, use technique='overlap_ddp' (it takes "
        "manual steps in the plain order), or train this module with strategy='ddp'."
    )


def refuse_manual(module: pl.LightningModule, loop: Any) -> None:
    """As Lightning's backward starts: raise :func:`manual_optimization_refusal` when
    ``module`` optimizes by hand and ``loop`` (the strategy's ``AutomaticOptimization``)
    frees gradients early (optimizer_in_backward on DDP, its optimizer attached). A few
    attribute reads per backward."""
    if (not module.automatic_optimization and loop.optimizer is not None
            and loop._freeing_ddp_model is not None):
        raise manual_optimization_refusal(loop.strategy_name, loop.technique)
