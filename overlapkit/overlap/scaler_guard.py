"""A ``torch.amp.GradScaler`` driving something other than the overlapped optimizer:
the optimizer handed in, a plain one over the same parameters, or a wrapper around the
overlapped one (Accelerate's ``AcceleratedOptimizer``).

The overlapped optimizer's own rules (``grad_scaler=``, its ``step()`` and
``param_groups`` seeing the scaler) are in :mod:`~overlapkit.overlap.rules.amp_scaler`.
A scaler given another object passed by them (measured on 0.4.0 before this module):

- ``scaler.step(optimizer)`` / ``scaler.unscale_(optimizer)`` on the instance adopted
  (``overlap_ddp(model, optimizer)``, a kept reference) or a plain optimizer over
  claimed parameters: under ``optimizer_in_backward`` (the gradients freed) torch's bare
  ``AssertionError: No inf checks were recorded for this optimizer``; under
  ``overlap_ddp`` the kept gradients unscaled in place, silently for ``unscale_``,
  ``step`` then refused as a plain step. Refused here, before the scaler touches a
  gradient (:func:`~overlapkit.overlap.plain_step_guard.adopted_step_refusal`'s test).
- the same on a wrapper whose ``.optimizer`` is the overlapped one (a hand-written AMP
  loop under ``overlapkit.integrations.accelerate.prepare``): the scaler unscales the
  gradients in place with ``torch._amp_foreach_non_finite_check_and_unscale_``, which
  bumps no version counter, so the window saw nothing: ``overlap_ddp`` stepped the
  scaled gradients during backward from the second step on, 0.030 off the plain run
  after 4 AdamW steps, silently. While the loop's first step is learnt
  (``learn_first_step``, as the integrations set up) that is the window used: noted
  (:attr:`~overlapkit.overlap.core.window.FirstWindow.scaler`), every step at
  ``step()`` in the plain order, bitwise, one warning; a scaler first seen once the
  steps happen during backward is refused before it touches a gradient.

- the same on a wrapper of an overlapped optimizer a later call replaced (a new
  ``overlap_ddp`` / ``optimizer_in_backward`` on its parameters): before this check
  (0.4.0 after the ninth round), the scaler unscaled the gradients the new call steps,
  then the old optimizer's ``step()`` refused (``overlap_ddp``), or torch's bare
  ``AssertionError`` on the freed gradients (``optimizer_in_backward``); refused here
  first (:func:`_refuse_replaced`). On a wrapper of a released one (``opt.release()``,
  set up without ``grad_scaler=`` or clipping), whose ``step()`` is a plain step of the
  kept gradients, it was refused as stepping during backward: honoured now, bitwise
  the plain run.

:func:`install` wraps ``GradScaler.step`` and ``unscale_`` once (with the plain-step
guard, at the first claim of parameters): a few attribute reads per scaler call,
nothing per parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from overlapkit.errors import ConfigurationError
from overlapkit.optimizer_wrapper import OptimizerWrapper
from overlapkit.overlap.core.watched_reads import quiet_reads
from overlapkit.overlap.plain_step_guard import (
    adopted_step_refusal,
    refuse_plain_step,
    refuse_retired,
)
from overlapkit.overlap.rules.amp_scaler import when_scaler_imported
from overlapkit.overlap.rules.late_clipping import current_stepper
from overlapkit.overlap.rules.released import is_released

__all__ = ["check_scaler_call", "install"]

_installed: list[bool] = []


def install() -> None:
    """Wrap ``torch.amp.GradScaler.step`` and ``unscale_``, and FSDP's
    ``ShardedGradScaler.unscale_`` now or as its module is imported (once;
    idempotent)."""
    if not _installed:
        _installed.append(True)
        when_scaler_imported(_wrap_scaler)


def _wrap_scaler(cls: type[torch.amp.GradScaler]) -> None:
    """Wrap the ``step`` and ``unscale_`` ``cls`` defines itself (GradScaler's both,
    ShardedGradScaler's own ``unscale_``)."""
    for name in ("step", "unscale_"):
        if name in vars(cls):
            setattr(cls, name, _guarded(vars(cls)[name], name))


def _guarded(method: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``GradScaler.<name>`` after :func:`check_scaler_call`."""
    @functools.wraps(method)
    def guarded(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        check_scaler_call(optimizer, name, self)
        if name == "step" and _set_up_with(optimizer) is self:
            # its own inf check (GradScaler._check_inf_per_device) reads the gradients:
            # not the loop's read (step() hands it the check of the step taken)
            with quiet_reads():
                return method(self, optimizer, *args, **kwargs)
        return method(self, optimizer, *args, **kwargs)
    return guarded


def _set_up_with(optimizer: Any) -> Any | None:
    """The ``grad_scaler=`` of an overlapped ``optimizer``, else None."""
    if not isinstance(optimizer, OptimizerWrapper):
        return None
    rule = getattr(getattr(optimizer, "_steps", None), "full_step", None)
    return getattr(rule, "grad_scaler", None)


def _facade_behind(optimizer: Any) -> Any | None:
    """The overlapped optimizer (an overlapkit wrapper with a step account, the facade:
    not imported here, it imports the set-up that installs this) a wrapper holds as
    ``.optimizer`` (Accelerate's) or ``._optimizer`` (Lightning's), a few levels deep,
    or None."""
    for _ in range(4):
        optimizer = getattr(optimizer, "optimizer", getattr(optimizer, "_optimizer", None))
        if isinstance(optimizer, OptimizerWrapper):
            return optimizer if hasattr(optimizer, "_steps") else None
        if optimizer is None:
            return None
    return None


def _path(wrapper: Any, facade: Any) -> str:
    """How to reach ``facade`` from ``wrapper``: ``optimizer.optimizer``, ..."""
    path, here = "optimizer", wrapper
    while here is not facade:
        name = "optimizer" if hasattr(here, "optimizer") else "_optimizer"
        here, path = getattr(here, name), f"{path}.{name}"
    return path


def check_scaler_call(optimizer: Any, name: str, scaler: Any = None) -> None:
    """Called first by ``scaler.step`` / ``scaler.unscale_`` (``name``) once installed.

    :raises ConfigurationError: ``optimizer`` is the real optimizer a live technique
        adopted, a plain optimizer over parameters one steps, or a wrapper around an
        overlapped optimizer whose steps are taken during backward (not learning its
        first step, not in the plain order) or that has ``grad_scaler=`` (which would
        unscale a second time). Raised before the scaler touches anything. Or
        ``optimizer`` is an overlapped one set up with another ``grad_scaler=``
        (:func:`_other_scaler`).
    """
    if isinstance(optimizer, OptimizerWrapper):
        steps = getattr(optimizer, "_steps", None)
        _refuse_replaced(steps, name)
        if steps is not None and is_released(steps):
            return  # a plain optimizer again: the scaler drives it as torch's
        _other_scaler(optimizer, name, scaler)
        return  # else the overlapped optimizer's own rules (rules.amp_scaler)
    facade = _facade_behind(optimizer)
    if facade is not None:
        _check_wrapper(optimizer, facade, name)
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    groups = optimizer.param_groups
    first = next((p for group in groups for p in group["params"]), None)
    stepper = None if first is None else current_stepper(first)
    if stepper is None or adopted_step_refusal(optimizer, groups) is None:
        refuse_plain_step(optimizer, (), {})  # a plain one over claimed parameters
        return
    technique = stepper.technique
    raise ConfigurationError(
        f"scaler.{name}(optimizer) was called on the {type(optimizer).__qualname__} that "
        f"{technique} adopted, not on the optimizer {technique} returned: it steps this "
        "one during backward itself, so the scaler would unscale gradients already "
        "stepped with and step them a second time. Nothing was changed. Pass the scaler "
        f"when setting up, opt = overlapkit.{technique}(model, optimizer, "
        "grad_scaler=scaler), and call scaler.step(opt) and scaler.update() on the "
        "optimizer it returned (leave out scaler.unscale_: clip with clip_grad_norm=)."
    )


def _other_scaler(optimizer: Any, name: str, scaler: Any) -> None:
    """:raises ConfigurationError: ``optimizer`` was set up with ``grad_scaler=`` another
    scaler than ``scaler``, which drives it: the steps were unscaled with the set-up
    scaler's scale, the loss scaled with this one's, and this one's ``update()`` would
    find no inf check (0.4.0: torch's bare ``AssertionError: No inf checks were recorded
    prior to update.``, the step taken)."""
    given = _set_up_with(optimizer)
    if given is None or scaler is None or given is scaler:
        return
    technique = getattr(optimizer, "_technique", type(optimizer).__name__)
    raise ConfigurationError(
        f"scaler.{name}(opt) by a torch.amp.GradScaler other than the one {technique} was "
        f"set up with (grad_scaler=): the steps during backward unscale the gradients "
        f"with that one's scale ({given.get_scale():g}) and hand it their inf check, "
        f"where this one scaled the loss ({scaler.get_scale():g}) and its update() would "
        "find no inf check. The backward before this call has been stepped with that "
        "scale. Use one scaler: the one passed as grad_scaler=, for scaler.scale(loss), "
        "scaler.step(opt) and scaler.update() (restart from the last checkpoint if the "
        "scales differed)."
    )


def _refuse_replaced(steps: Any, name: str) -> None:
    """:raises ConfigurationError: ``steps`` (an overlapped optimizer's) was replaced by
    a later call on its parameters. Its ``step()`` refuses too, but only once the
    scaler has unscaled the gradients (which the new call steps) through a wrapper, or
    found them freed (torch's bare ``AssertionError``); ``scaler.unscale_`` on it was
    refused as built without ``grad_scaler=``, which was not the reason."""
    if getattr(steps, "retired_by", None) is not None:
        refuse_retired(steps, f"scaler.{name}(optimizer)")


def _check_wrapper(wrapper: Any, facade: Any, name: str) -> None:
    """A scaler driving ``wrapper``, around ``facade``: honoured while the steps are
    taken at ``step()`` (the first step learnt, or the plain order kept), else refused."""
    steps = facade._steps
    _refuse_replaced(steps, name)
    rule = steps.full_step
    window = steps.first_window
    given = rule is not None and rule.grad_scaler is not None
    if is_released(steps):
        # it steps nothing during backward and its step() is the plain step (the set-up
        # clip only where the loop did not clip, the set-up scaler not applied again):
        # honoured (rules.released)
        return
    if not given and window is not None and steps.deferring:
        if not window.plain_order and window.scaler is None:  # the first step: the window
            # used (one warning at its step()); step() runs unscale_ first: named first
            window.scaler = f"{type(wrapper).__qualname__} (scaler.{name})"
        return
    technique = facade._technique
    why = ("its grad_scaler= already unscales and checks them at the end of backward, "
           "so this scaler would unscale them a second time" if given else
           "it steps during backward, on the scaled gradients with no inf check")
    raise ConfigurationError(
        f"a torch.amp.GradScaler drives the {type(wrapper).__qualname__} around the "
        f"optimizer of {technique} (scaler.{name}): {why}. Nothing was changed. Pass the "
        f"scaler when setting up, {technique}(..., grad_scaler=scaler), and call "
        f"scaler.step(opt) on the optimizer {technique} returned (inside this one: "
        f"scaler.step({_path(wrapper, facade)})); with Accelerate or "
        "OverlapTrainer, train in bf16 (mixed_precision='bf16'), or give the scaler "
        "from the first step (the integrations then take every step at step(), in the "
        "plain order)."
    )
