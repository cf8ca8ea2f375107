"""torch's two halves of ``clip_grad_norm_`` after a backward in which an overlapped
optimizer already stepped: ``torch.nn.utils.get_total_norm`` and
``clip_grads_with_norm_`` (torch 2.6+, what ``clip_grad_norm_`` calls inside), guarded
as :mod:`~overlapkit.overlap.rules.late_clipping` guards the whole (installed with it).

- ``clip_grads_with_norm_`` is answered where the optimizer applied that clip
  (``clip_grad_norm=`` over the same parameters) and otherwise refused before it
  touches a gradient (0.4.0: it clipped gradients a step had used, and ``step()``
  refused the edit afterwards);
- ``get_total_norm`` over gradients that ``optimizer_in_backward`` freed — ``None`` in
  the list, or none left after filtering them out — returns NaN with a
  :class:`~overlapkit.overlap.rules.late_clipping.FreedGradientNormWarning`, as
  ``clip_grad_norm_(..., max_norm=inf)`` does (0.4.0: torch's ``AttributeError`` from
  inside it, or a norm of 0 logged);
- an empty list given to any of the clips (``clip_grad_norm_``, ``clip_grad_value_``,
  ``clip_grads_with_norm_``) in that window is the loop's list of the parameters with
  a gradient (``[p for p in params if p.grad is not None]``), empty because
  ``optimizer_in_backward`` freed them all: :func:`given_or_freed` hands the clip those
  freed parameters, so it is answered or refused as a clip of them (0.4.0: torch's, of
  nothing: the steps unclipped, SGD 0.056 off the plain loop after 4 steps, a norm of 0
  returned, silently; ``clip_grad_value_``'s own ``RuntimeError`` from inside torch).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn.utils.clip_grad as torch_clip_grad

from overlapkit.overlap.core.window import quiet_reads, state
from overlapkit.overlap.rules.late_clipping import (
    _STEPPERS,
    FreedGradientNormWarning,
    _applied_norm,
    _as_list,
    _clipped_in_window,
    _refuse_other_clip_in_window,
    _stepped,
    late_clip_error,
)
from overlapkit.overlap.rules.released import note_loop_clip

__all__ = ["given_or_freed", "guarded_clip_grads_with_norm_", "guarded_get_total_norm",
           "stepped_answered", "unguarded_clip_grads_with_norm_", "unguarded_get_total_norm"]

# public as torch.nn.utils.clip_grads_with_norm_ / get_total_norm (torch 2.13)
unguarded_clip_grads_with_norm_ = torch_clip_grad._clip_grads_with_norm_
unguarded_get_total_norm = torch_clip_grad._get_total_norm


def guarded_clip_grads_with_norm_(parameters: Any, max_norm: float, total_norm: torch.Tensor,
                                  foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grads_with_norm_`` (the second half of ``clip_grad_norm_``),
    guarded as :func:`guarded_clip_grad_norm_`: unchanged for parameters no overlapped
    optimizer has stepped since its last ``step()``; a no-op where that optimizer
    applied this clip (same ``clip_grad_norm=``, same parameters).

    :raises ConfigurationError: any other clip of parameters already stepped, before it
        touches a gradient.
    """
    params = given_or_freed(_as_list(parameters))
    steppers = stepped_answered(params)
    if not steppers:
        _refuse_other_clip_in_window(params, float(max_norm), 2.0)
        before = [state(p) for p in params]
        with quiet_reads():
            unguarded_clip_grads_with_norm_(params, max_norm, total_norm, foreach)
        _clipped_in_window(params, before)
        if not math.isinf(float(max_norm)):
            note_loop_clip(params)  # a released optimizer's step() does not clip again
        return
    max_norm = float(max_norm)
    rule = steppers[0].global_step
    if (len(steppers) == 1 and rule is not None and rule.clipping.norm is not None
            and _applied_norm(steppers[0], params, max_norm, rule.clipping.norm_type)
            is not None):
        return
    raise late_clip_error(steppers[0].technique,
                          f"clip_grads_with_norm_(..., max_norm={max_norm:g})",
                          f"clip_grad_norm={max_norm:g}")


def guarded_get_total_norm(tensors: Any, norm_type: float = 2.0,
                           error_if_nonfinite: bool = False,
                           foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm``, unchanged, except after a backward in which
    ``optimizer_in_backward`` stepped and freed the gradients: given None among
    ``tensors`` (``[p.grad for p in params]``, where torch raises an ``AttributeError``
    from inside itself) or none at all (the Nones filtered out, where torch returns
    0), it returns NaN with a :class:`FreedGradientNormWarning`, as
    ``clip_grad_norm_(..., max_norm=inf)`` does: freed gradients have no norm.
    """
    listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not listed or any(each is None for each in listed):
        steppers = _freeing_steppers()
        if steppers:
            for stepper in steppers:  # a zero_grad() with no step() is refused
                stepper.freed_norm_read = True
                _answered(stepper)  # the loop's reads of .grad for it: warned of here
            freeing = steppers[0].technique
            warnings.warn(
                f"torch.nn.utils.get_total_norm asked for the norm of gradients that "
                f"{freeing} freed during backward (None, or none left): NaN is "
                f"returned. Pass clip_grad_norm= to {freeing} to have the norm computed "
                "(clip_grad_norm_(..., max_norm=inf) then returns it), or use "
                "overlap_ddp, which keeps the gradients.",
                FreedGradientNormWarning, stacklevel=2)
            return torch.tensor(float("nan"))
    return unguarded_get_total_norm(listed, norm_type, error_if_nonfinite, foreach)


def _freeing_steppers() -> list[Any]:
    """The steppers of overlapped optimizers whose last backward freed the gradients
    they stepped, each once (read on an error path only)."""
    found: dict[int, Any] = {}
    for ref in list(_STEPPERS.values()):
        stepper = ref()
        if stepper is not None and getattr(stepper, "freed", None):
            found[id(stepper)] = stepper
    return list(found.values())


def given_or_freed(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` as given to a clip, or, none given after a backward in which
    ``optimizer_in_backward`` stepped and freed the gradients (before ``step()``), the
    parameters it freed: the plain loop's ``[p for p in params if p.grad is not None]``
    (see the module docstring). That backward is the last that freed gradients, of any
    optimizer (another's, left in its window by a refused step, is not this one's). A
    list empty in the plain loop too (a frozen part's parameters) is taken for them as
    well: answered where the optimizer applied that clip, else refused."""
    steppers = [] if params else _freeing_steppers()
    if not steppers:
        return params
    last = max(steppers, key=lambda stepper: getattr(stepper, "freed_order", 0))
    if not last.stepped_since_step:
        return params
    return list(last.freed)


def _answered(stepper: Any) -> None:
    """A pass of the loop's reads of the gradients ``stepper`` freed went to a clip or a
    norm answered here: not a skipped change
    (:class:`~overlapkit.overlap.core.watched_params.FreedGradientReadWarning`)."""
    marks = stepper.stepped_marks
    if marks is not None and marks.param_reads is not None:
        marks.param_reads.answered()


def stepped_answered(params: list[torch.Tensor]) -> list[Any]:
    """The steppers that stepped some of ``params`` (a clip's, after
    :func:`given_or_freed`) since their last ``step()``; the clip answers for them, so
    one pass of the loop's reads of their freed gradients went to it (the filter of
    ``[p for p in params if p.grad is not None]``, Accelerate's look at each gradient
    before torch's clip): :func:`_answered`."""
    steppers = _stepped(params) if params else []
    for stepper in steppers:
        _answered(stepper)
    return steppers
