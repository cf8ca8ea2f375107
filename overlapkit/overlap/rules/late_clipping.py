"""A gradient clip that comes after the step it was meant for: never silently skipped.

``overlap_ddp`` and ``optimizer_in_backward`` step during backward. A loop, or a
framework, that clips with ``torch.nn.utils.clip_grad_norm_`` after ``backward()`` —
Hugging Face's ``Trainer`` does by default (``max_grad_norm=1.0``, through Accelerate),
as do Lightning and torchtitan — clips too late: the step has been taken unclipped, and
under ``optimizer_in_backward`` the gradients are already freed, so torch finds none,
clips nothing and returns a norm of 0 (measured on 0.2: 0.0153 off the plain Trainer run
after 6 steps, without a word; torchtitan #990).

torch's ``clip_grad_norm_`` has no hook, and the one thing it reads, ``param.grad``, is
None (or a gradient already used) by then. So the first overlapped optimizer set up
replaces ``torch.nn.utils.clip_grad_norm_`` and ``torch.nn.utils.clip_grad_value_`` with
:func:`guarded_clip_grad_norm_` and :func:`guarded_clip_grad_value_`, which look up the
parameters they are given (one weak-dictionary look-up per parameter, at clip time
only: nothing is added to the steps) and

- pass every call through unchanged whose parameters no overlapped optimizer has
  stepped since its last ``step()`` (a plain loop, an accumulation window's ``no_sync()``
  / ``no_step()`` backwards, a model no overlapped optimizer steps);
- answer a clip the optimizer already applied — it was set up with the same
  ``clip_grad_norm=`` (global scope) or ``clip_grad_value=``, over the same parameters —
  without touching anything: the norm returned is the one overlapkit clipped with,
  bitwise what torch would have returned before the plain ``step()``. That is what the
  trainer integrations (:mod:`overlapkit.integrations`) rely on;
- raise :class:`~overlapkit.errors.ConfigurationError` for any other clip: it could not
  change the step, so it is refused at the first clip, naming the option and the
  integration to use. ``max_norm=inf`` (a norm for logging, what the Trainer asks with
  ``max_grad_norm=0``) is answered with the gradients' norm where they were kept
  (``overlap_ddp``), else NaN with a warning: freed gradients have no norm. Asked right
  after the loop's own clip was answered, it is the clipped gradients' norm it asks
  for, answered the same way (never the norm before the clip).

torch's two halves of ``clip_grad_norm_`` (``get_total_norm``,
``clip_grads_with_norm_``) are guarded too: :mod:`~overlapkit.overlap.rules.clip_halves`.

Code that calls ``torch.nn.utils.clip_grad.clip_grad_norm_`` directly, or bound the
function to another name before the first overlapped optimizer existed, is not
guarded; overlapkit's own clipping calls :func:`unguarded_clip_grad_norm_`.
"""

from __future__ import annotations

import math
import sys
import types
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.utils.clip_grad as torch_clip_grad
from torch.utils.weak import WeakIdKeyDictionary

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.core.window import quiet_reads, state
from overlapkit.overlap.rules.released import note_loop_clip

__all__ = ["FreedGradientNormWarning", "current_stepper", "guarded_clip_grad_norm_",
           "guarded_clip_grad_value_", "install", "late_clip_error", "stepper_gone",
           "unguarded_clip_grad_norm_", "unguarded_clip_grad_value_", "watch", "unwatch"]

#: torch's own functions, which overlapkit's clipping calls (never the guarded ones)
unguarded_clip_grad_norm_ = torch_clip_grad.clip_grad_norm_
unguarded_clip_grad_value_ = torch_clip_grad.clip_grad_value_

# parameter -> weakref to the stepper (a StepAccount) stepping it during backward. The
# value is a weak reference: a strong one would keep the parameter (its key) alive.
_STEPPERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: per step rule, the norm a loop's clip by a finite norm was answered with (its
#: ``last_norm``): a clip by ``inf`` after it, in the same step, asks for the norm of
#: the clipped gradients (a norm logged after the clip), not that one
_ANSWERED: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()


class FreedGradientNormWarning(UserWarning):
    """``clip_grad_norm_(..., max_norm=inf)`` asked for the norm of gradients that
    ``optimizer_in_backward`` freed during backward: NaN was returned."""


def watch(params: Iterable[torch.Tensor], stepper: Any) -> None:
    """Record that ``stepper`` steps ``params`` during backward, and guard torch's
    clipping functions (:func:`install`). Called at set-up, and by ``add_param_group``.

    :param stepper: has ``stepped_since_step``, ``technique``, ``clipping`` and
        ``global_step`` (a :class:`~overlapkit.overlap.core.step_accounting.StepAccount`
        stepper).
    """
    install()
    ref = weakref.ref(stepper)
    for param in params:
        _STEPPERS[param] = ref


def stepper_gone(param: torch.Tensor) -> bool:
    """Whether the stepper recorded for ``param`` has been collected: the optimizer and
    the model that stepped it during backward are gone (dropped by the loop), so
    nothing steps it any more."""
    ref = _STEPPERS.get(param)
    return ref is not None and ref() is None


def current_stepper(param: torch.Tensor) -> Any | None:
    """The stepper recorded for ``param`` by :func:`watch`, or None: none recorded,
    or collected."""
    ref = _STEPPERS.get(param)
    return None if ref is None else ref()


def unwatch(params: Iterable[torch.Tensor]) -> None:
    """Forget the stepper of ``params`` (its optimizer was released): torch's clipping
    functions treat them as plain parameters again."""
    for param in params:
        _STEPPERS.pop(param, None)


def install() -> None:
    """Put the guarded functions in ``torch.nn.utils`` (once; idempotent)."""
    # the halves' guards build on this module's look-ups (same package, no circle)
    from overlapkit.overlap.rules.clip_halves import (
        guarded_clip_grads_with_norm_,
        guarded_get_total_norm,
    )

    utils = torch.nn.utils
    for name, guarded in (("clip_grad_norm_", guarded_clip_grad_norm_),
                          ("clip_grad_value_", guarded_clip_grad_value_),
                          ("clip_grads_with_norm_", guarded_clip_grads_with_norm_),
                          ("get_total_norm", guarded_get_total_norm)):
        if getattr(utils, name) is not guarded:
            setattr(utils, name, guarded)


def _as_list(parameters: Any) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _stepped(params: list[torch.Tensor]) -> list[Any]:
    """The steppers that stepped some of ``params`` in a backward since their last
    ``step()``, each once."""
    found: dict[int, Any] = {}
    for param in params:
        ref = _STEPPERS.get(param)
        stepper = ref() if ref is not None else None
        if stepper is not None and stepper.stepped_since_step:
            found[id(stepper)] = stepper
    return list(found.values())


def _refuse_other_clip_in_window(params: list[torch.Tensor], max_norm: float,
                                 norm_type: float) -> None:
    """A clip by norm in a deferred first step that is not the one the optimizer was
    set up with: the later steps, taken during backward, could not honour it, so it is
    refused now, before anything steps (``max_norm=inf``, a norm for logging, passes).
    The set-up ``max_norm`` over part of the optimizer's parameters (``model.transformer
    .parameters()``: the sixth probe found it refused after the second step was taken)
    is learnt instead: the loop then steps in the plain order, its clip the plain one."""
    if math.isinf(max_norm):
        return
    for param in params:
        stepper = _stepper_of(param)
        if getattr(stepper, "first_window", None) is None or not stepper.deferring:
            continue
        if stepper.first_window.plain_order:
            return  # every step is taken at step(): the loop's clip is the plain one
        rule = stepper.full_step
        clipping = None if rule is None else rule.clipping
        others = [p for p in params if p.grad is not None and _stepper_of(p) is not stepper]
        if others and clipping is not None and clipping.norm == max_norm:
            raise ConfigurationError(
                f"torch.nn.utils.clip_grad_norm_(..., max_norm={max_norm:g}) was called "
                f"before the first optimizer.step() over {len(others)} parameters with "
                f"gradients that this {stepper.technique} optimizer does not step (another "
                "optimizer's): from the second step on it clips during backward with the "
                "total norm of its own parameters' gradients only, not this call's. "
                "Nothing has stepped yet. Clip each optimizer's parameters in its own call "
                "(clip_grad_norm_(params_of_this_optimizer, ...)), or step them all with "
                f"one optimizer.{_framework_hint()}")
        asked = {id(p) for p in params}
        left_out = sum(1 for p, ref in list(_STEPPERS.items()) if ref() is stepper
                       and p.grad is not None and id(p) not in asked)
        if left_out and clipping is not None and clipping.norm == max_norm:
            stepper.first_window.clipped_part = left_out  # learnt: the plain order
            return
        if (clipping is None or clipping.norm != max_norm
                or float(clipping.norm_type) != float(norm_type)):
            option = f"clip_grad_norm={max_norm:g}" + (
                "" if float(norm_type) == 2.0 else f", clip_norm_type={float(norm_type):g}")
            raise ConfigurationError(
                f"torch.nn.utils.clip_grad_norm_(..., max_norm={max_norm:g}) was called "
                f"before the first optimizer.step(), and {stepper.technique} was not set "
                "up with this clip: from the second step on it steps during backward, "
                f"before such a call could clip. Nothing has stepped yet. Set it up with "
                f"{option} (the integration's clip_grad_norm= argument); it then clips "
                f"before each step, bitwise this call before a plain step().{_framework_hint()}")
        return


def _refuse_other_value_clip_in_window(params: list[torch.Tensor], clip_value: float) -> None:
    """A clip by value in a deferred first step that is not the one the optimizer was
    set up with: refused now, before anything steps, as a clip by norm is."""
    for param in params:
        stepper = _stepper_of(param)
        if getattr(stepper, "first_window", None) is None or not stepper.deferring:
            continue
        if stepper.first_window.plain_order or stepper.clipping.value == clip_value:
            return
        raise ConfigurationError(
            f"torch.nn.utils.clip_grad_value_(..., clip_value={clip_value:g}) was called "
            f"before the first optimizer.step(), and {stepper.technique} was not set up "
            "with this clip: from the second step on it steps during backward, before "
            "such a call could clip. Nothing has stepped yet. Set it up with "
            f"clip_grad_value={clip_value:g} (an option of the integration, e.g. "
            "overlapkit.integrations.accelerate.prepare(..., clip_grad_value=...)); it "
            "then clamps before each step, bitwise this call before a plain step()."
            f"{_framework_hint()}")


def _clipped_in_window(params: list[torch.Tensor], before: list[tuple[int, int]],
                       by_norm: bool = True, finite: bool = False) -> None:
    """The loop clipped gradients that a deferred first step keeps
    (:mod:`overlapkit.overlap.core.window`): its own clip, not an edit of them (and after a
    clip by norm, the full step does not clip by norm again). A clip by norm after one
    by a ``finite`` norm reads the clipped gradients (a norm logged after the clip)."""
    windows: dict[int, Any] = {}
    for param, was in zip(params, before, strict=True):
        stepper = _stepper_of(param)
        window = getattr(stepper, "first_window", None)
        if window is not None and stepper.deferring:
            windows[id(window)] = window
            window.clipped = window.clipped or by_norm
            window.clipped_by_loop(param, was)
        marks = getattr(stepper, "stepped_marks", None)
        if marks is not None:
            marks.clipped_by_loop(param, was)
    for window in windows.values():  # once per call
        window.note_clip(by_norm, finite)


def _stepper_of(param: torch.Tensor) -> Any:
    ref = _STEPPERS.get(param)
    return ref() if ref is not None else None


def _framework_hint() -> str:
    """What to use instead, for the framework calling the clip (read from the calling
    frames, the outermost framework first: the Trainer clips through Accelerate; only
    on the error path)."""
    modules = set()
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        modules.add(str(frame.f_globals.get("__name__", "")).partition(".")[0])
        frame = frame.f_back
    if "transformers" in modules:
        return (" Hugging Face's Trainer clips after backward (max_grad_norm, 1.0 by "
                "default): train with overlapkit.integrations.transformers.OverlapTrainer, "
                "which sets the optimizer up with the Trainer's clipping.")
    if modules & {"lightning", "pytorch_lightning"}:
        return " With Lightning, use overlapkit's Lightning integration."
    if "accelerate" in modules:
        return (" With Accelerate, set the model and optimizer up with "
                "overlapkit.integrations.accelerate.prepare(..., clip_grad_norm=...).")
    return ""


def late_clip_error(technique: str, call: str, option: str) -> ConfigurationError:
    """The error of a clip after a backward that already stepped, which the optimizer
    did not apply itself.

    :param call: the clip as called, e.g. ``"clip_grad_norm_(..., max_norm=1.0)"``.
    :param option: the set-up option that does it, e.g. ``"clip_grad_norm=1.0"``.
    """
    return ConfigurationError(
        f"torch.nn.utils.{call} was called after a backward in which {technique} had "
        "already stepped these parameters (it steps during backward), so this clip "
        "cannot change that step, which was taken unclipped. Have the optimizer clip "
        f"instead: {technique}(..., {option}) applies it before each step, bitwise "
        "torch's clipping before a plain step(), and this call then returns what it "
        f"clipped with.{_framework_hint()} The parameters have already taken this step: "
        "restart from the last checkpoint after fixing the set-up."
    )


def _applied_norm(stepper: Any, params: list[torch.Tensor], max_norm: float,
                  norm_type: float) -> torch.Tensor | None:
    """The total norm ``stepper`` clipped this backward's gradients with, when that
    clip is the one asked for (same ``max_norm`` — or ``inf``, a norm only — same norm,
    over the same parameters); else None."""
    rule = stepper.global_step
    if rule is None or rule.last_norm is None or rule.clipping.norm is None:
        return None
    if float(norm_type) != float(rule.clipping.norm_type):
        return None
    if not (max_norm == rule.clipping.norm or math.isinf(max_norm)):
        return None
    asked = {id(p) for p in params}
    if any(id(p) not in asked for p in rule.last_clipped):
        return None  # it clipped gradients this call leaves out
    if any(p.grad is not None and _stepper_of(p) is not stepper for p in params):
        return None  # this call includes gradients the optimizer did not clip
    return rule.last_norm


def guarded_clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                            error_if_nonfinite: bool = False,
                            foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, unchanged for parameters no overlapped
    optimizer has stepped since its last ``step()``; see the module docstring for the
    others.

    :raises ConfigurationError: a clip the optimizer stepping these parameters during
        backward did not apply (it would come after the step).
    """
    from overlapkit.overlap.rules.clip_halves import given_or_freed, stepped_answered

    is_generator = isinstance(parameters, types.GeneratorType)
    params = given_or_freed(_as_list(parameters))
    steppers = stepped_answered(params)
    if not steppers:
        # an empty generator is handed on as one: torch warns that nothing is clipped
        given = (p for p in params) if is_generator else params
        _refuse_other_clip_in_window(params, float(max_norm), norm_type)
        before = [state(p) for p in params]
        with quiet_reads():  # the loop's clip, honoured as such: not a read of its own
            total = unguarded_clip_grad_norm_(given, max_norm, norm_type,
                                              error_if_nonfinite, foreach)
        _clipped_in_window(params, before, finite=not math.isinf(float(max_norm)))
        if not math.isinf(float(max_norm)):
            note_loop_clip(params)  # a released optimizer's step() does not clip again
        return total
    max_norm = float(max_norm)
    if len(steppers) == 1:
        rule = steppers[0].global_step
        after_clip = (math.isinf(max_norm) and rule is not None and rule.last_norm is not None
                      and _ANSWERED.get(rule) is rule.last_norm)
        norm = None if after_clip else _applied_norm(steppers[0], params, max_norm, norm_type)
        if norm is not None:
            if not math.isinf(max_norm):
                _ANSWERED[rule] = norm
            if error_if_nonfinite and not bool(torch.isfinite(norm)):
                raise RuntimeError(
                    f"The total norm of order {float(norm_type)} for gradients from "
                    "`parameters` is non-finite, so it cannot be clipped. To disable "
                    "this error and scale the gradients by the non-finite norm anyway, "
                    "set `error_if_nonfinite=False`")
            return norm
    technique = steppers[0].technique
    if math.isinf(max_norm):
        if all(p.grad is not None for p in params if _stepper_of(p) in steppers
               and p.requires_grad):
            # the gradients that were stepped are still there (overlap_ddp): their norm,
            # and a clip by inf changes nothing
            before = [state(p) for p in params]
            total = unguarded_clip_grad_norm_(params, max_norm, norm_type,
                                              error_if_nonfinite, foreach)
            _clipped_in_window(params, before)  # by inf: a scale of 1.0, not an edit
            return total
        for stepper in steppers:
            stepper.freed_norm_read = True  # a zero_grad() with no step() is refused
        warnings.warn(
            f"clip_grad_norm_(..., max_norm=inf) asked for the norm of gradients that "
            f"{technique} freed during backward: NaN is returned. Pass "
            f"clip_grad_norm= to {technique} to have the norm computed (the steps then "
            "wait for the end of backward).",
            FreedGradientNormWarning, stacklevel=2)
        return torch.tensor(float("nan"))
    raise late_clip_error(
        technique, f"clip_grad_norm_(..., max_norm={max_norm:g})",
        f"clip_grad_norm={max_norm:g}"
        + ("" if float(norm_type) == 2.0 else f", clip_norm_type={float(norm_type):g}"))


def guarded_clip_grad_value_(parameters: Any, clip_value: float,
                             foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_``, unchanged for parameters no overlapped
    optimizer has stepped since its last ``step()``; a no-op where that optimizer was
    set up with the same ``clip_grad_value=`` (it clamped before each step).

    :raises ConfigurationError: any other clip of parameters already stepped.
    """
    from overlapkit.overlap.rules.clip_halves import given_or_freed, stepped_answered

    params = given_or_freed(_as_list(parameters))
    steppers = stepped_answered(params)
    if not steppers:
        _refuse_other_value_clip_in_window(params, float(clip_value))
        before = [state(p) for p in params]
        with quiet_reads():
            unguarded_clip_grad_value_(params, clip_value, foreach)
        _clipped_in_window(params, before, by_norm=False)  # clamping again changes nothing
        note_loop_clip(params)
        return
    if len(steppers) == 1 and steppers[0].clipping.value == float(clip_value) and all(
            p.grad is None or _stepper_of(p) is steppers[0] for p in params):
        return
    raise late_clip_error(steppers[0].technique,
                          f"clip_grad_value_(..., clip_value={float(clip_value):g})",
                          f"clip_grad_value={float(clip_value):g}")
