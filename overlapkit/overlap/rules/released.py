"""The step rules of an optimizer after ``opt.release()``: a plain optimizer again.

A released optimizer steps nothing during backward; its ``step()`` is the full step of
the kept gradients. Before the eleventh round that step still applied every rule the
optimizer was set up with, where the loop had taken them over:

- set up with ``clip_grad_norm=``, the loop's own ``clip_grad_norm_`` before ``step()``
  (the plain loop's, which torch's clip runs unguarded once released) was followed by
  the set-up clip of the clipped gradients: clipped twice, 3e-8 off the plain loop
  after 3 AdamW steps, silently (and a scaler driving it refused for that reason);
- a ``torch.amp.GradScaler`` driving it was refused as "built without grad_scaler=",
  whose steps during backward "used the scaled gradients": none are taken once
  released; set up with ``grad_scaler=``, ``scaler.unscale_(opt)`` was refused as
  unscaling what the end of backward already unscaled and stepped.

Now a released optimizer's ``step()`` is the plain optimizer's under whatever the loop
does: a scaler drives it as it drives a plain optimizer (torch's own unscale, inf check
and skipped step: the facade no longer claims ``_step_supports_amp_scaling``); the set-up
clip is applied only where the loop did not clip these gradients itself since the last
``step()`` / ``zero_grad()`` (:func:`note_loop_clip`, from the guarded clipping
functions, one dictionary look-up per parameter clipped while a released optimizer set
up to clip is alive); the set-up scaler never unscales again.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["is_released", "loop_clipped", "note_loop_clip", "note_release", "released_rule"]

#: the parameters of released optimizers set up to clip -> their step account
_CLIPPING: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: the step accounts whose gradients the loop clipped since their last step()
_CLIPPED: weakref.WeakSet[Any] = weakref.WeakSet()
#: a released step account -> the rule its step() applies (the clip, no scaler)
_RULES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def note_release(steps: Any, params: Iterable[torch.Tensor]) -> None:
    """``steps`` (a step account) was released: from now on its ``step()`` is the plain
    one (:func:`released_rule`)."""
    from overlapkit.overlap.rules.global_step import GlobalStep  # it imports the clips

    rule = getattr(steps, "full_step", None)
    if rule is None or not rule.clipping.enabled:
        _RULES[steps] = None
        return
    _RULES[steps] = (rule if rule.grad_scaler is None
                     else GlobalStep(rule.clipping, None, order=rule.order))
    ref = weakref.ref(steps)
    for param in params:
        _CLIPPING[param] = ref


def is_released(steps: Any) -> bool:
    """Whether ``steps`` was released (:func:`note_release`)."""
    return steps in _RULES


def note_loop_clip(params: Iterable[torch.Tensor]) -> None:
    """torch's clip ran, unguarded, on ``params``: a released optimizer set up to clip
    any of them does not clip them again at its next ``step()``."""
    if not _CLIPPING:
        return
    for param in params:
        ref = _CLIPPING.get(param)
        steps = None if ref is None else ref()
        if steps is not None:
            _CLIPPED.add(steps)


def loop_clipped(steps: Any) -> bool:
    """Whether the loop clipped ``steps``'s gradients since the last call (which
    forgets it: ``step()`` and ``zero_grad()`` call it)."""
    if steps in _CLIPPED:
        _CLIPPED.discard(steps)
        return True
    return False


def released_rule(steps: Any) -> Any | None:
    """The rule (a :class:`~overlapkit.overlap.rules.global_step.GlobalStep`, without a
    scaler) a released ``steps``'s ``step()`` applies: the set-up clip, unless the loop
    clipped itself (then None: the plain step)."""
    rule = _RULES.get(steps)
    return None if loop_clipped(steps) else rule
