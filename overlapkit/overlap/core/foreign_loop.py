"""An overlapped optimizer stepped by a framework's loop that overlapkit does not set up:
Hugging Face's plain ``Trainer`` handed an overlapkit optimizer through ``optimizers=``.

That loop clips after backward (``max_grad_norm``, 1.0 by default) and accumulates
gradients without pausing the steps (``gradient_accumulation_steps``), and callbacks
and overrides may read or change gradients between backward and ``step()``
(:func:`trainer_window_users`): each makes the run differ from the plain one. 0.3
raised only at the first clip, or at the first ``step()`` ending an accumulation
window — after 1 or 2 steps were taken. The first stepping backward now looks for the
``Trainer`` in the calling frames (once per optimizer; on CPU the autograd hooks run in
the thread that called backward, so it is there; on a GPU's autograd thread it is not,
and the later refusals remain) and refuses that backward before anything steps in it.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from overlapkit.errors import ConfigurationError

__all__ = ["WINDOW_EVENTS", "WINDOW_METHODS", "foreign_trainer_refusal", "trainer_window_users"]

#: the Trainer's callback events inside the window between backward and step
WINDOW_EVENTS = ("on_pre_optimizer_step", "on_optimizer_step")

#: the Trainer's methods whose override may work in that window (two backwards, an edit
#: of ``.grad`` before returning the loss; a clip or a gradient norm of one's own, called
#: between backward and ``optimizer.step()``; the loop itself) or keep the optimizer they
#: build
WINDOW_METHODS = ("training_step", "create_optimizer", "_clip_grad_norm", "_get_grad_norm",
                  "_run_epoch", "_inner_training_loop")


def trainer_window_users(trainer: Any, skip: tuple[type, ...] = ()) -> list[str]:
    """What in a Hugging Face ``Trainer``'s run works in the window between backward and
    ``optimizer.step()``: an override of :data:`WINDOW_METHODS` in any class of its MRO
    but ``Trainer`` and ``skip`` (a base listed after ``OverlapTrainer`` too), a
    callback overriding one of :data:`WINDOW_EVENTS`. A callback class, or a Trainer
    subclass, declaring ``overlapkit_reads_no_gradients = True`` is left out. One of
    :data:`WINDOW_METHODS` set on the trainer instance (``trainer.training_step =
    types.MethodType(f, trainer)``, a patch the Trainer's loop calls) counts as an
    override: before, it was not seen (a patched ``training_step`` editing ``.grad``
    was silently 0.030 off the plain run, a patched ``_clip_grad_norm`` refused after
    the step it was meant for)."""
    from transformers import Trainer, TrainerCallback

    found = []
    overriding = [klass for klass in type(trainer).__mro__
                  if klass not in (*skip, Trainer, object)]
    for name in () if getattr(trainer, "overlapkit_reads_no_gradients", False) \
            else WINDOW_METHODS:
        if name in vars(trainer):
            found.append(f"{name} set on the {type(trainer).__qualname__} instance "
                         "(a patch)")
            continue
        for klass in overriding:
            if name in vars(klass):
                found.append(f"{klass.__qualname__}.{name} (an override)")
                break
    for callback in trainer.callback_handler.callbacks:
        if getattr(callback, "overlapkit_reads_no_gradients", False):
            continue
        for event in WINDOW_EVENTS:  # overridden by its class, or set on the instance
            if event in vars(callback) or (
                    getattr(type(callback), event) is not getattr(TrainerCallback, event)):
                found.append(f"the callback {type(callback).__qualname__}.{event}")
    return found


def _trainer_in_frames() -> Any | None:
    """The Hugging Face ``Trainer`` (not overlapkit's ``OverlapTrainer``) whose method is
    on the stack, or None."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        # only transformers' own frames: reading f_locals keeps a snapshot of the
        # frame's locals alive with it (CPython < 3.13), so a loop's `del model, opt`
        # freed nothing until its function returned (issue 31 probe)
        own = str(frame.f_globals.get("__name__", "")).startswith("transformers.")
        candidate = frame.f_locals.get("self") if own else None
        if candidate is not None and any(
                klass.__name__ == "Trainer"
                and klass.__module__.startswith("transformers.")
                for klass in type(candidate).__mro__):
            return None if hasattr(candidate, "overlap_technique") else candidate
        frame = frame.f_back
    return None


def foreign_trainer_refusal(technique: str) -> ConfigurationError | None:
    """The error for a first stepping backward run by a plain ``Trainer`` that clips,
    accumulates or works in the window between backward and step
    (:func:`trainer_window_users`), else None."""
    trainer = _trainer_in_frames()
    if trainer is None:
        return None
    args = trainer.args
    settings = []
    max_norm = getattr(args, "max_grad_norm", None)
    if max_norm is not None and max_norm > 0:
        settings.append(f"max_grad_norm={max_norm:g} (a clip after backward, which "
                        "has already stepped)")
    accumulate = getattr(args, "gradient_accumulation_steps", 1)
    if accumulate > 1:
        settings.append(f"gradient_accumulation_steps={accumulate} (a step in every "
                        "backward instead of one per accumulation window)")
    problems = [f"whose {' and '.join(settings)} it cannot honour"] if settings else []
    users = trainer_window_users(trainer)
    if users:
        problems.append(f"where {', '.join(users)} may read or change the gradients "
                        "between backward and optimizer.step(), a window it removes")
    if not problems:
        return None
    return ConfigurationError(
        f"an overlapkit {technique} optimizer was handed to Hugging Face's plain Trainer, "
        f"{'; '.join(problems)}: it steps during backward. "
        "Nothing has stepped yet. Give the plain optimizer (or none) to "
        "overlapkit.integrations.transformers.OverlapTrainer(technique=...), which sets "
        "the technique up with the Trainer's clipping and accumulation, and takes the "
        "steps in the plain order where the run works in that window."
    )
