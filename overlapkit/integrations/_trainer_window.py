"""The window between backward and ``optimizer.step()`` in Hugging Face's ``Trainer``
loop, for :class:`~overlapkit.integrations.transformers.OverlapTrainer` (private to
:mod:`overlapkit.integrations.transformers`): the one warning of a run taken in the
plain order (:func:`plain_order_warning`), what the loop itself does there that a
step during backward cannot follow (:func:`unsynced_micro_batch`), and a
``compute_loss`` of one's own that runs a backward itself or hooks code into the
Trainer's (:func:`watched_compute_loss`), a ``step`` patched on the optimizer the
Trainer steps (:func:`step_patched_around`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from overlapkit.integrations._accelerate_window import (
    forward_past_ddp_refusal,
    steps_paused,
    watch_forwards_past_ddp,
)
from overlapkit.overlap.core.step_hooks import instance_override
from overlapkit.overlap.core.window import state as gradient_state

__all__ = ["UNSYNCED_MICRO_BATCH", "compute_loss_of_ones_own", "compute_loss_watched",
           "plain_order_warning", "step_patched_around", "unsynced_micro_batch",
           "watched_compute_loss"]

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


def step_patched_around(prepared: Any) -> list[str]:
    """A ``step`` set on the optimizer the Trainer calls ``step()`` on (``trainer.optimizer``,
    Accelerate's ``AcceleratedOptimizer``) or on the overlapped optimizer inside it: a
    wrapper a callback installs at ``on_train_begin`` (``optimizer.step = noisy_step``,
    changing ``.grad`` before calling the saved ``step``) runs in the window between
    backward and step. Before (the eleventh probe), it was not seen: under
    ``optimizer_in_backward`` its edit read freed gradients (a warning, the run silently
    0.036 off the plain ``Trainer``). A few attribute reads per micro-batch; the real
    optimizer's own patch is :func:`~overlapkit.overlap.core.step_hooks.step_override`'s."""
    found = []
    for holder in (prepared, getattr(prepared, "optimizer", None)):
        patch = instance_override(holder) if isinstance(holder, torch.optim.Optimizer) else None
        if patch is not None:
            found.append(patch)
    return found


def compute_loss_of_ones_own(trainer: Any, skip: tuple[type, ...]) -> str | None:
    """The qualified name of the ``compute_loss`` override in ``trainer``'s class (or a
    class of its MRO but ``Trainer`` and ``skip``), ``"compute_loss_func"`` when one was
    given to the Trainer, else None (or when the trainer declares
    ``overlapkit_reads_no_gradients``): code of the user's run in the Trainer's
    ``training_step``, which may run a backward of its own (an auxiliary loss) or hook
    code into the Trainer's (a cached, GradCache-style loss re-running the forward in
    chunks from a hook on the loss). One set on the instance (``trainer.compute_loss =
    types.MethodType(f, trainer)``) counts too: before, it was not watched, and an
    auxiliary backward in it stepped, then the Trainer's ``optimizer.step()`` refused
    the second stepping backward, the parameters moved already)."""
    from transformers import Trainer

    if getattr(trainer, "overlapkit_reads_no_gradients", False):
        return None
    if "compute_loss" in vars(trainer):
        return f"compute_loss set on the {type(trainer).__qualname__} instance (a patch)"
    for klass in type(trainer).__mro__:
        if klass in (*skip, Trainer, object):
            continue
        if "compute_loss" in vars(klass):
            return f"{klass.__qualname__}.compute_loss"
    return "compute_loss_func" if getattr(trainer, "compute_loss_func", None) else None


def _gradient_marks(model: torch.nn.Module) -> list[tuple[int, int]]:
    """Per parameter, the window's mark of its gradient (:func:`~overlapkit.overlap.core.
    window.state`: identity and version): what a backward changes, stepped or not."""
    return [gradient_state(p) for p in model.parameters()]


def watched_compute_loss(compute_loss: Callable[..., Any], name: str, model: torch.nn.Module,
                         facade: Any, plain_order: Callable[[list[str]], None] | None,
                         ddp: DistributedDataParallel | None = None,
                         ) -> Callable[..., Any]:
    """``compute_loss`` (the user's, ``name``), run with the steps deferred
    (``facade.defer_steps()``: a backward in it reduces as usual, keeps its gradients
    and steps nothing), then ``plain_order(users)`` when it ran a backward (a gradient
    of ``model`` changed: a gradient changed in place, of the micro-batches accumulated
    before, shows the same way) or returned a loss with a hook on it (code run during the
    Trainer's backward: a cached loss running its chunks' backwards there): the step
    is then taken at ``optimizer.step()``, before the Trainer's own backward steps
    anything. Before (the eighth probe), each such backward stepped, and the first
    ``optimizer.step()`` refused a window of several stepping backwards after the
    parameters had taken them. Steps deferred already (a step hook) stay deferred;
    ``plain_order`` None (the run is in the plain order): not watched for that. On
    ``ddp``, a forward that went past its wrapper (``self.model(**inputs)``, where the
    Trainer gives ``compute_loss`` the DDP model) is refused as it returns (before: on 2
    ranks ``overlap_ddp`` silently 1.2e-7 off the plain run, ``optimizer_in_backward``
    refused naming ``find_unused_parameters``)."""

    @functools.wraps(compute_loss)
    def watched(*args: Any, **kwargs: Any) -> Any:
        before = _gradient_marks(model)
        if ddp is not None:
            watch_forwards_past_ddp(ddp)
            forward_past_ddp_refusal([ddp], lambda _: "")  # clear: what came before
        if plain_order is None or facade._steps.deferring:  # nothing steps in it now
            result = compute_loss(*args, **kwargs)
        else:
            with facade.defer_steps():
                result = compute_loss(*args, **kwargs)
        if ddp is not None:
            refusal = forward_past_ddp_refusal(
                [ddp], lambda _: facade._technique, f"{name}, calling self.model",
                "Call the model compute_loss is given (the DDP model), not self.model.")
            if refusal is not None:
                raise refusal
        if plain_order is None:
            return result
        loss = result[0] if isinstance(result, tuple) else result
        users = []
        if _gradient_marks(model) != before:
            users.append(f"{name} (it ran a backward of its own, or changed a gradient)")
        if isinstance(loss, torch.Tensor) and getattr(loss, "_backward_hooks", None):
            users.append(f"{name} (it returned a loss with a hook on it, code run during "
                         "the Trainer's backward)")
        if users:
            plain_order(users)
        return result

    return watched


@contextmanager
def compute_loss_watched(trainer: Any, facade: Any, skip: tuple[type, ...]) -> Iterator[None]:
    """Inside, the trainer's ``compute_loss`` of one's own
    (:func:`compute_loss_of_ones_own`), if any, is :func:`watched_compute_loss` (an
    attribute of the instance, removed after): while the run overlaps, one that uses
    the window turns the rest of the run to the plain order from this step, before the
    Trainer's backward; on DDP, in any order, one whose forward went past the DDP
    wrapper (``self.model(**inputs)``) is refused there, nothing stepped."""
    name = compute_loss_of_ones_own(trainer, skip)
    ddp = trainer.model_wrapped
    ddp = ddp if isinstance(ddp, DistributedDataParallel) else None
    if (name is None or not isinstance(trainer.model, torch.nn.Module)
            or (trainer.overlap_off_by and ddp is None)):
        yield
        return

    def plain_order(users: list[str]) -> None:
        trainer._overlap_loop_users = trainer._overlap_loop_users + users
        trainer.set_up_overlap(from_step=trainer.state.global_step + 1)

    patched = vars(trainer).get("compute_loss")  # the user's patch, put back after
    trainer.compute_loss = watched_compute_loss(
        trainer.compute_loss, name, trainer.model, facade,
        None if trainer.overlap_off_by else plain_order, ddp)
    try:
        yield
    finally:
        if patched is None:
            del trainer.compute_loss
        else:
            trainer.compute_loss = patched


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
    if any(".compute_loss (it " in user or "compute_loss_func (it " in user
           for user in users):
        hints.append("run no backward in compute_loss and hook nothing into the loss it "
                      "returns (a backward of its own steps the parameters during it)")
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
