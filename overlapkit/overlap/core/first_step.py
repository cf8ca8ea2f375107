"""The end of a learnt first step: the plain order kept, with its one warning, or the
overlap from the second step on, and what shows only after that step.

At the ``step()`` of a first window that
:meth:`~overlapkit.overlap.facade.OverlappedOptimizerFacade.learn_first_step` deferred,
:func:`end_first_window` reads what :class:`~overlapkit.overlap.core.window.FirstWindow`
noted (the loop used the window: every step stays at ``step()``, bitwise the plain loop,
warned once by :func:`plain_order_warning`). What a loop does between that ``step()``
and its next backward can also tell: no ``zero_grad()`` there under
``optimizer_in_backward`` (:func:`follow_kept_gradients`). ``zero_grad(set_to_none=False)``
before any gradient was freed is warned of by :func:`zeros_warning`, after one was
refused by :func:`zeros_refusal`.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.core.window import FirstWindow, shown_names

__all__ = ["end_first_window", "follow_kept_gradients", "plain_order_warning",
           "zeros_refusal", "zeros_warning"]


def plain_order_warning(technique: str, used: str) -> str:
    """The one warning of a loop that uses the window: what it did, how to keep the
    overlap."""
    return (
        f"{technique} takes every step of this loop at optimizer.step(), in the plain "
        f"order, without overlap: {used} between backward and optimizer.step(), a window "
        "that stepping during backward removes. The run is the plain loop's, bitwise. To "
        "keep the overlap: accumulate gradients inside accelerator.accumulate(model) (or "
        "the model's no_sync()), and change gradients before they are reduced (a DDP "
        "comm hook, a gradient hook on the parameter) instead of between backward and "
        "step()."
    )


def zeros_warning(technique: str, what: str = "zero_grad(set_to_none=False)") -> str:
    """``zero_grad(set_to_none=False)`` in a loop that learnt its first step
    (``learn_first_step``), before any backward has freed a gradient: honoured by taking
    every later step at ``step()`` in the plain order, the gradients kept (and zeroed) as
    the plain loop keeps them, where
    :func:`zeros_refusal` would stop the run at
    the next ``zero_grad`` (Accelerate: after two steps, the sixth probe). ``what`` keeps
    them: the call, or an override of ``zero_grad`` (:mod:`~overlapkit.overlap.core.
    zeroing`)."""
    return (f"{technique} takes every step of this loop from now on at optimizer.step(), in "
            f"the plain order, without overlap: {what} keeps a zero "
            "gradient for every parameter, which it would free once stepped. The run is the "
            "plain loop's, bitwise. To keep the overlap: call zero_grad() (set_to_none=True, "
            "torch's default)" + ("." if what.startswith("zero_grad(") else
                                  ", and let the optimizer's zero_grad set them to None."))


def end_first_window(steps: Any, names: Mapping[int, str], params: list[torch.Tensor],
                     technique: str) -> bool:
    """At ``step()`` while the facade's ``learn_first_step`` defers: decide whether the
    loop keeps the plain order (warned once), and whether it clipped the kept gradients
    itself (the full step then does not clip again); returns the latter.

    :param steps: the facade's :class:`~overlapkit.overlap.backward_steps.BackwardSteps`.
    """
    window = steps.first_window
    assert window is not None
    clipped = window.clipped
    if window.loop_clips is not None and not window.plain_order and not window.clipped_to_norm:
        raise ConfigurationError(
            f"{technique} was set up with clip_grad_norm={window.loop_clips:g} (the loop's "
            "clip), but the loop called no clip_grad_norm_ with it between its backward and "
            "this first optimizer.step(): the plain loop's step is then not clipped, and "
            f"{technique} would clip every step during backward. Nothing has stepped yet. "
            "Clip before optimizer.step() (accelerator.clip_grad_norm_(model.parameters(), "
            f"{window.loop_clips:g})), or pass clip_grad_norm=None if the loop does not clip.")
    if not window.plain_order:
        used = []
        if window.backwards > 1:
            used.append(f"{window.backwards} backwards ran before one optimizer.step() "
                        "(gradient accumulation outside accelerator.accumulate)")
        edited = window.edited(dict(names), params)
        if window.scaler is not None:
            used.append(f"a torch.amp.GradScaler drove the {window.scaler}, unscaling the "
                        "gradients")
        if edited:
            used.append(f"the gradients of {shown_names(edited)} were changed")
        changed = window.changed_settings()
        if changed:
            used.append(f"the optimizer's settings ({shown_names(changed)}) were changed "
                        "(the plain step takes the new values)")
        moved = window.moved(dict(names), params)
        if moved:
            used.append(f"the values of {shown_names(moved)} were changed in place")
        if torch.is_inference_mode_enabled():  # 968cf42: torch's bare RuntimeError later
            used.append("optimizer.step() ran under torch.inference_mode() (the state it "
                        "creates there cannot be updated during backward, outside it)")
        if window.discarded:
            used.append("zero_grad() discarded the gradients of a backward without a step "
                        "(a second optimizer's loss reaching these parameters)")
        if window.clipped_per_backward:  # twelfth probe: was the text below
            used.append("clip_grad_norm_ was called after each backward of one step "
                        "(every micro-batch of the accumulation, not only where "
                        "accelerator.sync_gradients is true: the plain one clips the "
                        "partial sums and returns their norms)")
        elif window.clipped_again:
            used.append("clip_grad_norm_ was called again after the loop's clip (the "
                        "plain one returns the clipped gradients' norm)")
        if window.clipped_part:
            used.append(f"clip_grad_norm_ left out {window.clipped_part} of the "
                        "optimizer's parameters (its clip during backward would take "
                        "the norm over all of them)")
        if window.state_read:
            used.append(f"the optimizer's state was read (from the second step on it "
                        f"would hold that step's update already: {technique} steps "
                        "during backward)")
        if window.params_read:
            values = shown_names([names.get(key, "a parameter") for key in window.params_read])
            used.append(f"the values of {values} were read (an EMA, a copy, a log: from "
                        "the second step on they would hold that step's update already: "
                        f"{technique} steps during backward; read them after "
                        "optimizer.step() to keep the overlap)")
        read = [name for name in window.read if name not in edited]
        if read:
            shown = shown_names(read)
            freed = ("frees them once stepped" if technique == "optimizer_in_backward"
                     else "clips them during backward")
            used.append(f"the gradients of {shown} were read (from the second step on "
                        f"they would not be the plain loop's: {technique} {freed})")
        if used:
            window.plain_order = True
            warnings.warn(plain_order_warning(technique, "; ".join(used)),
                          UserWarning, stacklevel=4)
    window.unwatch(params)  # after edited(), which compares the watched gradients
    if window.plain_order:
        window.reset()
    else:  # from now on every step is taken during backward
        if technique == "optimizer_in_backward":  # gradients kept by this step: freed later
            steps.kept_by_learning = [(p, weakref.ref(p.grad)) for p in params
                                      if p.grad is not None]
        steps.first_window = None
        steps.learned = True
        steps.deferring = False
        steps.deferred()
        # the loop called step() after its backward: a load or a checkpoint in a later
        # window is refused before it changes anything (StepAccount.window_refusal)
        steps.calls_step = steps.steps_after_backward = True
    return clipped


def follow_kept_gradients(steps: Any) -> None:
    """At the start of the first backward after the ``step()`` that ended a learnt first
    window under ``optimizer_in_backward`` (a
    :class:`~overlapkit.overlap.core.step_accounting.StepAccount`'s
    ``starting_backward``): the gradients that step kept are still there when no
    ``zero_grad()`` (the optimizer's, the model's, ``p.grad = None``) came in between.
    Such a loop adds every backward to the last gradients, which a step during backward
    frees: every step from this backward on is taken at ``step()`` in the plain order
    (gradients kept as the plain loop keeps them), bitwise, one warning."""
    kept, steps.kept_by_learning = steps.kept_by_learning, None
    # the same gradient objects (weakly held: a zeroed one is freed): autograd adds to
    # them in place, so one this backward has reached already still counts
    if kept is None or steps.deferring or all(
            p.grad is None or p.grad is not grad() for p, grad in kept):
        return
    steps.first_window = FirstWindow(optimizer=steps.settings_of, plain_order=True,
                                     learned=True)
    steps.deferring = True
    warnings.warn(plain_order_warning(
        steps.technique, "no zero_grad() came between optimizer.step() and the next "
        "backward, which adds its gradients to the last step's (kept by the plain loop, "
        f"freed by {steps.technique} once stepped): a loop that never zeroes them, or "
        "another loss reaching these parameters (a GAN's generator loss reaching the "
        "discriminator)") + " Or call optimizer.zero_grad() after optimizer.step() (and "
        "keep other losses from these parameters: requires_grad_(False) on them).",
        UserWarning, stacklevel=4)


def zeros_refusal(technique: str,
                  what: str = "zero_grad(set_to_none=False)") -> ConfigurationError:
    """``zero_grad(set_to_none=False)`` after a backward that stepped and freed the
    gradients: the plain loop holds a zero gradient for each parameter from then on,
    which its ``step()`` steps even where a backward does not reach the parameter (Adam
    moves it on its moments, weight decay shrinks it). Here they are None (freed): a
    parameter no backward reaches is not stepped. Zeros given back would keep the memory
    the technique saves, and still need that step; so refused, before anything changes
    (every step so far was the plain one: it had no gradient to zero before). ``what``
    zeroes: the call, or an override of ``zero_grad`` (:mod:`~overlapkit.overlap.core.
    zeroing`), whose call zeroed none (they were freed)."""
    fix = ("Call zero_grad() (set_to_none=True, torch's default): every gradient is None "
           "then, as here, and the run is the plain loop's." if what.startswith("zero_grad(")
           else "Let the optimizer's zero_grad() set them to None (torch's default: the run "
           "is then the plain loop's), or call opt.learn_first_step(model) once before the "
           "first backward: every step is then taken at step(), in the plain order, the "
           "zeros kept, bitwise the plain loop.")
    return ConfigurationError(
        f"{what} after a backward that {technique} stepped: it "
        "frees each gradient once stepped, where the plain loop keeps a zero gradient "
        "for every parameter from here on (the plain step() steps it even when a "
        "backward does not reach the parameter, and the loop may read it). Nothing was "
        f"zeroed. {fix}")
