"""A plain optimizer stepping parameters an overlapped optimizer steps during backward:
refused before it steps.

A loop that builds a plain ``torch.optim.SGD(model.parameters())`` while its
``overlap_ddp`` / ``optimizer_in_backward`` optimizer is still live (held, or dropped:
the model's hooks hold it) would have each backward stepped by the overlapped one and
the plain one step the same parameters again — a step the plain loop never takes
(measured on main before 0.4: a loop calling ``zero_grad()`` was refused only at the
next backward, after the parameters had changed). On a plain module, a dropped
optimizer whose loop called ``step()`` is released at the next forward instead
(:func:`~overlapkit.overlap.rebuild.orphan_when_dropped`), and passes.

So the first claim (:func:`~overlapkit.overlap.setup.claim_params`) installs
:func:`refuse_plain_step` as torch's global optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``), once. It passes, at the
cost of a counter comparison and a dictionary look-up per step, an optimizer already
found to step no claimed parameter since the last claim (measured: 167.7 against
164.8 us for an SGD step of 200 parameters, within noise); overlapkit's own optimizers
(the facades, and each engine's real optimizer) always pass, and the engines' steps
still skip torch's step wrapper (``direct_step.PASSING_PRE_HOOKS``). Parameters left
to a plain optimizer with ``params=`` are not claimed and are never refused.

The optimizer a technique adopted (``overlap_ddp(model, optimizer)``, a Lightning
``configure_optimizers``' one) steps through its engine, which holds its lock then; its
own ``step()`` called by the loop through a reference kept to it (instead of the
overlapped optimizer's) is refused the same way (:func:`adopted_step_refusal`): after a
backward that stepped, it would step the parameters again from the gradients
``overlap_ddp`` keeps (measured before this check: AdamW 0.081 off the plain loop after 4
steps, silently), and it would pass by the clipping, the loss scaler and the loop's
step accounting of the overlapped optimizer's ``step()``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from overlapkit.errors import ConfigurationError
from overlapkit.optimizer_wrapper import OptimizerWrapper
from overlapkit.overlap.core.direct_step import PASSING_PRE_HOOKS
from overlapkit.overlap.rules.late_clipping import current_stepper

__all__ = ["adopted_step_refusal", "claims_changed", "install", "refuse_plain_step",
           "refuse_retired", "release_advice", "retired_error"]

_installed: list[Any] = []
#: bumped at every claim: a plain optimizer checked before it is checked again
_generation = [0]
#: optimizer -> (generation, number of parameters) when found to step no claimed one
_passed: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = (
    weakref.WeakKeyDictionary())


def release_advice(technique: str, model: str = "model") -> str:
    """How to release a ``technique`` optimizer the loop no longer holds (dropped: the
    model's hooks step it on), for a refusal's message that says to call its
    ``release()``: a new call of the same technique on the same model covering all of
    its parameters replaces it (:mod:`~overlapkit.overlap.rebuild`), and that one's
    ``release()`` releases it; bitwise the plain loop from there."""
    return (f" If you no longer hold it (dropped: the model's hooks still step it), a new "
            f"call replaces it, and its release() releases it: "
            f"overlapkit.{technique}({model}, torch.optim.SGD).release() (on every rank "
            "of a DDP model; the same model, all of the earlier call's parameters).")


def install() -> None:
    """Register :func:`refuse_plain_step` with torch (once; idempotent)."""
    if not _installed:
        # it passes the engines' optimizers: their steps still skip torch's wrapper
        PASSING_PRE_HOOKS.add(refuse_plain_step)
        _installed.append(register_optimizer_step_pre_hook(refuse_plain_step))


def claims_changed() -> None:
    """Parameters were claimed: check every plain optimizer again at its next step."""
    _generation[0] += 1


def refuse_plain_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global step pre-hook.

    :raises ConfigurationError: ``optimizer`` holds a parameter that a live overlapped
        optimizer (not released, not replaced) steps during backward, and is not that
        optimizer's own real optimizer.
    """
    if isinstance(optimizer, OptimizerWrapper):
        return
    groups = optimizer.param_groups
    refusal = adopted_step_refusal(optimizer, groups)
    if refusal is not None:
        raise refusal
    key = (_generation[0], sum(len(group["params"]) for group in groups))
    if _passed.get(optimizer) == key:
        return
    for group in groups:
        for param in group["params"]:
            stepper = current_stepper(param)
            if (stepper is None or getattr(stepper, "retired_by", None) is not None
                    or stepper.engine.optimizer is optimizer):
                continue
            raise ConfigurationError(
                f"this {type(optimizer).__qualname__} steps a parameter of shape "
                f"{tuple(param.shape)} that a live {stepper.technique} optimizer already "
                "steps during backward, so the parameter would be stepped twice: this "
                "step is refused (the backward before it was stepped by that optimizer). "
                f"Call release() on the {stepper.technique} optimizer before stepping a "
                "plain optimizer on its parameters, or leave them out of it with "
                "params=." + release_advice(stepper.technique) + " Then zero the "
                "gradients (this optimizer's zero_grad()) and go on with the next batch: "
                "this one was stepped."
            )
    _passed[optimizer] = key


def adopted_step_refusal(optimizer: torch.optim.Optimizer,
                         groups: list[dict[str, Any]]) -> ConfigurationError | None:
    """The refusal of ``optimizer.step()`` where ``optimizer`` is the real optimizer of a
    live overlapped one and its engine is not the caller (the engine holds its lock
    while it steps, on the thread that steps), else None. Its first parameter tells:
    every parameter of a real optimizer is watched with its stepper."""
    param = next((p for group in groups for p in group["params"]), None)
    stepper = None if param is None else current_stepper(param)
    if (stepper is None or getattr(stepper, "retired_by", None) is not None
            or stepper.engine.optimizer is not optimizer
            or stepper.engine.lock._is_owned()):
        return None
    technique = stepper.technique
    kept = " (from the gradients it keeps)" if technique == "overlap_ddp" else ""
    return ConfigurationError(
        f"step() was called on the {type(optimizer).__qualname__} that {technique} adopted, "
        f"not on the optimizer {technique} returned: {technique} steps it during backward "
        f"itself, so this step() would step the parameters a second time{kept}, past its "
        "clipping, loss scaler and step accounting. "
        "Nothing was stepped. Call step() and zero_grad() on the optimizer "
        f"{technique} returned (a no-op after a backward that stepped), or release() it "
        "first to step this one as a plain optimizer."
    )


def retired_error(stepper: Any, what: str) -> ConfigurationError | None:
    """The error of ``what`` (``"step()"``) on an optimizer whose ``stepper`` a later
    call replaced, or None while it is not retired."""
    by = getattr(stepper, "retired_by", None)
    if by is None:
        return None
    return ConfigurationError(
        f"this {stepper.technique} optimizer was replaced by a later {by} call on the "
        f"same parameters and no longer steps them, so {what} on it would do nothing "
        f"the loop expects; use the optimizer that {by} call returned (the old one's "
        "state_dict() still reads, to carry its state over: "
        "new.load_state_dict(old.state_dict()))."
    )


def refuse_retired(stepper: Any, what: str) -> None:
    """:raises ConfigurationError: :func:`retired_error`, where ``stepper`` is retired."""
    error = retired_error(stepper, what)
    if error is not None:
        raise error
