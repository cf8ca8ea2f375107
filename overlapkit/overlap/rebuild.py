"""A new optimizer built on a model an overlapkit optimizer already steps.

In plain PyTorch building a second optimizer on the same model is legal and common: a
second phase with another optimizer or learning rate, a reset after a loss spike, a
fine-tune after unfreezing. An overlapped optimizer steps during backward from hooks
on the model (a DDP model's comm hook, a plain module's per-parameter hooks), and those
hooks hold it: a loop that never keeps the returned optimizer (backward only) trains
through them. So a later ``overlap_ddp`` / ``optimizer_in_backward`` call over the
parameters an earlier one steps takes them over when the earlier one

- was released (``opt.release()``): nothing of it steps any more;
- was dropped by a loop that called its ``step()``, on a plain module
  (:func:`orphan_when_dropped`: it is released at the model's next forward), or is
  gone with its model, or
- is fully replaced: every parameter it steps is in the new call (the reassign idiom
  ``opt = overlap_ddp(ddp_model, ...)``, where the earlier object is still alive
  during the call).

The replaced optimizer is *retired*: its hooks are removed (a DDP model's comm hook
now dispatches to the new stepper), and its later ``step()``, ``zero_grad()`` or
``add_param_group()`` raises, naming the call that replaced it. Its ``state_dict()``
still reads (to carry its state into the new one).

Refused, before anything changes, where the takeover would be ambiguous: the new call
covers only part of a live optimizer's parameters (it would keep stepping the rest),
or it comes between a stepping backward and ``step()`` (that optimizer step is half
taken), unless the earlier optimizer was dropped (:func:`mark_when_dropped`): its
``step()`` cannot come, and the refusals naming ``release()`` tell a loop that no longer
holds it to release it with a new call (:func:`~overlapkit.overlap.plain_step_guard.
release_advice`).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.plain_step_guard import (  # re-exported: the facades import them here
    refuse_retired,
    release_advice,
    retired_error,
)
from overlapkit.overlap.rules.late_clipping import current_stepper, unwatch
from overlapkit.overlap.rules.released import note_release
from overlapkit.overlap.setup import check_unclaimed, unclaim_params

T = TypeVar("T")

__all__ = ["before_forward_hook", "check_takeover", "live_stepper_of", "mark_when_dropped",
           "orphan_when_dropped",
           "plan_takeover", "refuse_retired", "release_steps", "retire", "retired_error"]


def live_stepper_of(param: torch.Tensor) -> Any | None:
    """The stepper (a :class:`~overlapkit.overlap.core.step_accounting.StepAccount`)
    stepping ``param`` during backward, or None: none, released, retired or collected."""
    stepper = current_stepper(param)
    if stepper is None or getattr(stepper, "retired_by", None) is not None:
        return None
    return stepper


def plan_takeover(params: Iterable[torch.Tensor], technique: str,
                  replaceable: Callable[[Any], bool], also: Any | None = None) -> list[Any]:
    """The live steppers a new ``technique`` call over ``params`` replaces: each one
    ``replaceable`` by it (the same kind of model: a DDP model's comm hook is replaced
    only on that model), whose parameters are all in ``params``. Changes nothing; the
    parameters of the others are left to
    :func:`~overlapkit.overlap.setup.check_unclaimed`.

    :param also: a stepper the call replaces whatever parameters it steps (the one
        bound to a DDP model's comm hook: the model takes one).
    :raises ConfigurationError: a live stepper steps some of ``params`` and others not
        in them; or one has stepped in a backward whose ``step()`` has not come yet.
    """
    params = list(params)
    found: dict[int, Any] = {}
    for param in params:
        stepper = live_stepper_of(param)
        if stepper is not None and replaceable(stepper):
            found[id(stepper)] = stepper
    if found:
        gc.collect()  # a dropped model's stepper may be waiting in a reference cycle
        found = {key: s for key, s in found.items()
                 if any(live_stepper_of(p) is s for p in params)}
    if also is not None and getattr(also, "retired_by", None) is None:
        found[id(also)] = also
    new = {id(p) for p in params}
    for stepper in found.values():
        owner = stepper.technique
        left = [p for p in stepper.engine.parameters() if id(p) not in new]
        if left and not getattr(stepper, "orphaned", False):
            disjoint = (also is not None and stepper is also
                        and len(left) == len(also.engine.parameters()))
            raise ConfigurationError(
                f"this {technique} call covers only part of the parameters an earlier "
                f"{owner} optimizer still steps during backward ({len(left)} of its "
                f"parameters, e.g. one of shape {tuple(left[0].shape)}, are not in "
                f"params), so that one would keep stepping them. Release the earlier "
                f"optimizer first (opt.release()), or pass params= covering all of its "
                "parameters to replace it." + release_advice(owner)
                + (" A DDP model is stepped by one overlapped optimizer (it takes one "
                   "comm hook): for two optimizers over different parameters (an "
                   "encoder and a decoder), pass them as param groups of one call, each "
                   "group with its own settings, or leave the second's parameters out of "
                   "params= and step them with a plain optimizer." if disjoint else "")
            )
        # a dropped one's step() cannot come: taken over (retire() ends its window)
        ends = getattr(stepper, "dropped", False) and not getattr(stepper, "deferring", False)
        if stepper.stepped_since_step and not ends:
            raise ConfigurationError(
                f"an earlier {owner} optimizer on these parameters has stepped during "
                f"a backward whose step() has not been called yet, so this {technique} "
                "call would replace it in the middle of an optimizer step; call "
                "step() (and zero_grad()) on it first, then build the new optimizer."
            )
    return list(found.values())


def check_takeover(params: Iterable[torch.Tensor], technique: str,
                   replaceable: Callable[[Any], bool], also: Any | None = None) -> list[Any]:
    """:func:`plan_takeover`, then refuse what steps the other parameters during
    backward (:func:`~overlapkit.overlap.setup.check_unclaimed`: torch's
    ``_apply_optimizer_in_backward``). Changes nothing."""
    params = list(params)
    plan = plan_takeover(params, technique, replaceable, also)
    replaced = {id(stepper) for stepper in plan}
    check_unclaimed([p for p in params if id(live_stepper_of(p)) not in replaced], technique)
    return plan


def retire(steppers: Iterable[Any], technique: str) -> None:
    """Stop each of ``steppers`` stepping (its hooks removed, its parameters no longer
    claimed: the new call claims them next) and mark it replaced by ``technique``: its
    optimizer's ``step()``, ``zero_grad()`` and ``add_param_group()`` raise
    :func:`retired_error` from now on, before anything (:func:`refuse_retired`)."""
    for stepper in steppers:
        release_steps(stepper, stepper.engine.parameters())
        stepper.retired_by = technique
        if stepper.stepped_since_step:  # dropped (plan_takeover): as its step() would
            stepper.release_state()
            marks, stepper.stepped_marks = stepper.stepped_marks, None
            if marks is not None:
                marks.release_state()
            stepper.stepped_since_step = False


def mark_when_dropped(optimizer: T) -> T:
    """Return ``optimizer`` (a facade), its stepper marked ``dropped`` once it is
    collected: its ``step()`` cannot come any more, so a new call may take over in the
    middle of its optimizer step (:func:`plan_takeover`) — after a plain optimizer's
    step was refused (:mod:`~overlapkit.overlap.plain_step_guard`), the backward before
    it stepped by the dropped one, that refusal's advice (a new call, released) is
    followable. Never where its steps are deferred to ``step()`` (learnt first window):
    they would be lost. Each rank marks its own; :func:`plan_takeover` collects before
    it reads the mark, on every rank."""
    weakref.finalize(optimizer, _mark_dropped, weakref.ref(optimizer._steps))  # type: ignore[attr-defined]
    return optimizer


def _mark_dropped(stepper_ref: weakref.ref[Any]) -> None:
    stepper = stepper_ref()
    if stepper is not None:
        stepper.dropped = True


def orphan_when_dropped(optimizer: T) -> T:
    """Return ``optimizer`` (a facade on a plain module), its stepper marked orphaned
    once it is collected, where its loop called ``step()`` after its backwards: no
    ``step()`` can come any more, so the loop has gone on without it (a plain
    optimizer, another call). Its next forward then releases it
    (:func:`before_forward_hook`), never in the middle of a backward, where a collection
    may run. A loop that never called ``step()`` (backward only: PyTorch's
    ``_apply_optimizer_in_backward`` idiom, which keeps no optimizer) keeps training
    through the model's hooks.

    Not on a DDP or FSDP2 model: its ranks need not collect their optimizers at the
    same moment (one in a reference cycle waits for a collection), and one rank
    stepping in backward while another no longer does would drift apart or hang. There
    a dropped optimizer steps on until ``release()`` or a new call replaces it, and a
    plain optimizer beside it is refused (:mod:`~overlapkit.overlap.plain_step_guard`)
    on every rank."""
    weakref.finalize(optimizer, _orphan, weakref.ref(optimizer._steps))  # type: ignore[attr-defined]
    return optimizer


def _orphan(stepper_ref: weakref.ref[Any]) -> None:
    stepper = stepper_ref()
    if stepper is not None and stepper.calls_step:
        stepper.orphaned = True


def before_forward_hook(module: torch.nn.Module, args: Any, stepper: Any) -> None:
    """The model's forward pre-hook (bound to ``stepper`` by an
    :class:`~overlapkit.overlap.core.own_hooks.OwnHook`): ``stepper``'s own
    ``before_forward()``, then its release if orphaned (:func:`orphan_when_dropped`)."""
    stepper.before_forward()
    if getattr(stepper, "orphaned", False):
        stepper.orphaned = False
        release_steps(stepper, stepper.engine.parameters())


def release_steps(stepper: Any, params: list[torch.Tensor]) -> None:
    """``opt.release()``: ``stepper`` stops stepping ``params`` during backward (its
    hooks removed; a DDP model's comm hook reduces alone), which are no longer claimed
    nor guarded against torch's clipping. Nothing for a retired stepper: the
    parameters are its successor's."""
    if getattr(stepper, "retired_by", None) is not None:
        return
    remove = getattr(stepper, "remove", None)
    if remove is not None:
        remove()
    unclaim_params(params)
    unwatch(params)
    note_release(stepper, params)  # its step() is the plain one from now on
