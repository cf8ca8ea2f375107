"""The window between backward and ``optimizer.step()`` in Hugging Face's ``Trainer``
loop, for :class:`~overlapkit.integrations.transformers.OverlapTrainer` (private to
:mod:`overlapkit.integrations.transformers`): the one warning of a run taken in the
plain order (:func:`plain_order_warning`), and what the loop itself does there that a
step during backward cannot follow (:func:`unsynced_micro_batch`).
"""

from __future__ import annotations

from typing import Any

from overlapkit.integrations._accelerate_window import steps_paused

__all__ = ["UNSYNCED_MICRO_BATCH", "plain_order_warning", "unsynced_micro_batch"]

#: why a run turns to the plain order at a micro-batch the Trainer runs outside
#: ``accelerator.no_sync`` that ends no optimizer step (:func:`unsynced_micro_batch`)
UNSYNCED_MICRO_BATCH = (
    "a micro-batch run outside no_sync() that ends no optimizer step (the last of an "
    "epoch shorter than gradient_accumulation_steps, which a dataset without a length "
    "gives: the plain Trainer reduces its gradients and adds the next epoch's to them "
    "before it steps), whose backward would have stepped")


def unsynced_micro_batch(trainer: Any) -> list[str]:
    """:data:`UNSYNCED_MICRO_BATCH` when the micro-batch about to run its backward ends no
    optimizer step (the Trainer's ``do_sync_step``, which it sets as
    ``accelerator.sync_gradients`` before ``training_step``) and yet runs outside
    ``accelerator.no_sync`` (the Trainer runs the last micro-batch it fetched outside,
    whether or not it ends the step): its backward would step, where the plain Trainer
    steps only after the next epoch's first micro-batches. Seen before that backward;
    before, it stepped, and the next step's last backward was refused as a second
    backward (0.0252 off the plain run by then)."""
    accelerator = trainer.accelerator
    if accelerator.gradient_state.sync_gradients or steps_paused(accelerator):
        return []
    return [UNSYNCED_MICRO_BATCH]


def plain_order_warning(technique: str, users: list[str], from_step: int | None) -> str:
    """The one warning of a run (or, ``from_step``, the rest of one) whose steps are taken
    at the Trainer's ``optimizer.step()`` because of ``users``."""
    steps = ("every step of this run" if from_step is None
             else f"every step from step {from_step} on")
    hints = ["do that work in on_step_end or on_step_begin instead, or, for a callback "
             "(or a Trainer subclass) that reads no gradients there, set the class "
             "attribute overlapkit_reads_no_gradients = True",
             "set max_grad_norm and requires_grad before train() and leave them, and "
             "give the optimizer every parameter that requires grad",
             "move gradient edits and second backwards out of training_step",
             "give a custom optimizer through optimizers=(optimizer, None) instead of a "
             "create_optimizer override"]
    if any("JITCheckpointCallback." in user for user in users):
        hints.insert(0, "leave enable_jit_checkpoint off (its JITCheckpointCallback saves a "
                        "checkpoint between backward and step when the job is told to stop, "
                        "so on_pre_optimizer_step must see the plain step's state)")
    if UNSYNCED_MICRO_BATCH in users:
        hints.append("give each epoch a number of batches that gradient_accumulation_steps "
                     "divides (a dataset with a length, dataloader_drop_last)")
    return (
        f"OverlapTrainer(technique={technique!r}) takes {steps} at the "
        "Trainer's optimizer.step(), in the plain order, without overlap: "
        f"{', '.join(users)} (each may read or change the gradients or the optimizer "
        "between backward and step, or make the Trainer's clip there differ from the one "
        "set up: a window that stepping during backward removes). The run is "
        f"the plain Trainer's. To keep the overlap: {'; '.join(hints)}."
    )
