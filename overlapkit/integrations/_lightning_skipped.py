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
``optimizer_in_backward`` frees those, so a fit with that callback is seen at
set-up (:func:`swa_batch_norm_epoch`) and its last training step, the one before that
epoch, is taken in the plain order, which keeps them (:func:`swa_last_training_step`,
asked before each ``training_step``); ``overlap_ddp`` keeps them and turns to the plain
order for that epoch's step only (:func:`skipped_backward`). Before the thirteenth probe
the first was refused at that last step, after the whole fit had run, saying ``step()``
was called twice (one device) or that ``training_step`` returned None (DDP), and
``overlap_ddp``'s warning said the latter too; in the thirteenth round every step of an
``optimizer_in_backward`` fit was taken in the plain order.

Private to :mod:`overlapkit.integrations.lightning`.
"""

from __future__ import annotations

from typing import Any, cast

import lightning.pytorch as pl
from lightning.pytorch.callbacks import StochasticWeightAveraging

from overlapkit.errors import ConfigurationError

__all__ = ["SKIPPED_BACKWARD", "SWA_BATCH_NORM_EPOCH", "SWA_LAST_TRAINING_STEP",
           "skipped_backward", "swa_batch_norm_epoch", "swa_last_training_step"]

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


#: why ``optimizer_in_backward`` takes the last training step before that epoch in the
#: plain order, and that nothing need change
SWA_LAST_TRAINING_STEP = (
    f"{SWA_BATCH_NORM_EPOCH[0]}, which optimizer_in_backward would have freed",
    "nothing to change: every training step before it overlapped; a module without "
    "BatchNorm has no such epoch")


def swa_batch_norm_epoch(trainer: pl.Trainer, module: pl.LightningModule
                         ) -> StochasticWeightAveraging | None:
    """The callback when ``trainer`` has a ``StochasticWeightAveraging`` (or a
    subclass) that will add its BatchNorm epoch to this fit (``module`` has BatchNorm
    and ``max_epochs`` is not -1), seen at set-up: ``optimizer_in_backward`` would
    have freed the gradients that epoch's step takes again, so it keeps those of the
    last training step before it (:func:`swa_last_training_step`)."""
    if trainer.max_epochs == -1 or not StochasticWeightAveraging.pl_module_contains_batch_norm(
            module):
        return None
    # cast: Lightning types Trainer.callbacks by a property mypy does not see (and without
    # Lightning installed, as in tox's `checks`, the Trainer is Any: an ignore goes unused)
    for callback in cast(Any, trainer).callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            return callback
    return None


def swa_last_training_step(trainer: pl.Trainer, callback: StochasticWeightAveraging) -> bool:
    """Whether the micro-batch whose ``training_step`` is about to run ends the last
    epoch before ``callback``'s BatchNorm epoch (so ends an optimizer step: Lightning
    steps on an epoch's last batch): its gradients are the ones that epoch's step takes
    again. Asked before each ``training_step`` of an ``optimizer_in_backward`` fit with
    the callback (a few attribute reads); a fit that stops before (``max_steps``,
    ``EarlyStopping``) has no BatchNorm epoch and never gets there."""
    loop = trainer.fit_loop
    # swa_end: the callback's last epoch, from max_epochs as on_fit_start read it
    return (not getattr(loop, "_skip_backward", False)
            and trainer.current_epoch == callback.swa_end
            and loop.epoch_loop._num_ready_batches_reached())


def skipped_backward(trainer: pl.Trainer, freeing: bool, probing: bool) -> tuple[str, str]:
    """Why an optimizer step whose closure ran no backward turns the rest of the fit to
    the plain order, and how to keep the overlap: :data:`SWA_BATCH_NORM_EPOCH` while
    Lightning skips the backward (``fit_loop._skip_backward``), else
    :data:`SKIPPED_BACKWARD`. ``probing``: that step is the fit's first, so nothing was
    freed before it (a fit resumed from a checkpoint of the epoch before SWA's BatchNorm
    epoch: the plain run steps no gradients there either; before the fourteenth probe
    ``optimizer_in_backward`` on DDP refused it, saying it had freed them).

    :raises ConfigurationError: ``freeing`` (``optimizer_in_backward`` on DDP, whose
        early freeing of the gradients would lose some), before that step.
    """
    swa = bool(getattr(trainer.fit_loop, "_skip_backward", False))
    why, keep = SWA_BATCH_NORM_EPOCH if swa else SKIPPED_BACKWARD
    if not freeing or (swa and probing):
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
