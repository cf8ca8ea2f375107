"""Lightning optimizer steps that end a window without a backward, in the words of the
one warning (or the refusal) that says so.

Two things make Lightning's automatic loop call ``optimizer.step(closure)`` whose closure
runs no backward: a ``training_step`` returning None for the micro-batch that ends an
accumulation window (the batch skipped), and ``StochasticWeightAveraging`` on a module
with BatchNorm, whose extra last epoch (added to ``max_epochs``) runs the forwards only
(``fit_loop._skip_backward``: no ``zero_grad``, no backward), to recompute the BatchNorm
statistics of the averaged weights, and ends with one optimizer step. That step is the
plain step of the gradients still in ``.grad``: the last training step's, stepped again
(Lightning zeroes the gradients at the start of a window, not after the step).
``optimizer_in_backward`` has freed those, so a fit with that callback is seen at
set-up (:func:`swa_batch_norm_epoch`) and stepped in the plain order from its first
step; ``overlap_ddp`` keeps them and turns to the plain order for that last step only
(:func:`skipped_backward`). Before the thirteenth probe the first was refused at that
last step, after the whole fit had run, saying ``step()`` was called twice (one device)
or that ``training_step`` returned None (DDP), and ``overlap_ddp``'s warning said the
latter too.

Private to :mod:`overlapkit.integrations.lightning`.
"""

from __future__ import annotations

from typing import Any, cast

import lightning.pytorch as pl
from lightning.pytorch.callbacks import StochasticWeightAveraging

from overlapkit.errors import ConfigurationError

__all__ = ["SKIPPED_BACKWARD", "SWA_BATCH_NORM_EPOCH", "skipped_backward",
           "swa_batch_norm_epoch"]

#: why a DDP fit turns to the plain order when a synchronised micro-batch's
#: training_step returns None (Lightning skips its backward): DDP's reducer stays
#: prepared, so the next backward reduces even inside no_sync(), and the gradients
#: accumulated before are stepped unreduced
SKIPPED_BACKWARD = (
    "training_step returned None in a micro-batch that ends an optimizer step on DDP, so "
    "that step takes the gradients accumulated before it unreduced, and DDP's next "
    "backward reduces even inside no_sync() (its forward prepared it for the backward "
    "that never came)",
    "skip a batch by a zero loss (loss * 0) instead of returning None, or skip only "
    "batches that do not end an accumulation window")

#: why the last optimizer step of a fit with ``StochasticWeightAveraging`` on a module
#: with BatchNorm is taken in the plain order, and how to keep the overlap there
SWA_BATCH_NORM_EPOCH = (
    "StochasticWeightAveraging's extra epoch for the BatchNorm statistics (forwards "
    "only, no backward, no zero_grad) ends with an optimizer step, which steps the "
    "gradients of the fit's last training step again, as the plain loop does",
    "nothing to change: the training steps before that epoch overlapped; a module "
    "without BatchNorm has no such epoch")


def swa_batch_norm_epoch(trainer: pl.Trainer, module: pl.LightningModule) -> str | None:
    """The callback's name when ``trainer`` has a ``StochasticWeightAveraging`` (or a
    subclass) that will add its BatchNorm epoch to this fit (``module`` has BatchNorm
    and ``max_epochs`` is not -1): a user of the window for ``optimizer_in_backward``,
    which would have freed the gradients that epoch's step takes again."""
    if trainer.max_epochs == -1 or not StochasticWeightAveraging.pl_module_contains_batch_norm(
            module):
        return None
    # cast: Lightning types Trainer.callbacks by a property mypy does not see (and without
    # Lightning installed, as in tox's `checks`, the Trainer is Any: an ignore goes unused)
    for callback in cast(Any, trainer).callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            return (f"{type(callback).__name__} (its BatchNorm epoch's optimizer step "
                    "steps the gradients of the last training step again)")
    return None


def skipped_backward(trainer: pl.Trainer, freeing: bool) -> tuple[str, str]:
    """Why an optimizer step whose closure ran no backward turns the rest of the fit to
    the plain order, and how to keep the overlap: :data:`SWA_BATCH_NORM_EPOCH` while
    Lightning skips the backward (``fit_loop._skip_backward``), else
    :data:`SKIPPED_BACKWARD`.

    :raises ConfigurationError: ``freeing`` (``optimizer_in_backward`` on DDP, whose
        early freeing of the gradients would lose some), before that step.
    """
    swa = bool(getattr(trainer.fit_loop, "_skip_backward", False))
    why, keep = SWA_BATCH_NORM_EPOCH if swa else SKIPPED_BACKWARD
    if not freeing:
        return why, keep
    if swa:
        raise ConfigurationError(
            f"{why}: optimizer_in_backward has freed those gradients, so it cannot take "
            "that step as the plain run does. Nothing was stepped in this step. Use "
            "technique='overlap_ddp' (it keeps the gradients).")
    raise ConfigurationError(
        f"{why}: under optimizer_in_backward on DDP the gradients of that "
        "early reduction are freed, so the next optimizer step would lose some, where the "
        "plain run keeps them. Nothing was stepped in this step. To keep training: "
        f"{keep}, or use technique='overlap_ddp' (it honours this in the "
        "plain order).")
