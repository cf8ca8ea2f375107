"""A ``step`` patched on the optimizer instance (``optimizer.step = wrapper``): code
around the step, as an override of ``step()`` in a subclass is
(:mod:`~overlapkit.overlap.core.step_hooks`), unless it only notes the call (torch's
LR-scheduler wrapper) or says it runs per part stepped (:data:`PER_PART_MARK`).

:func:`instance_override` is asked as each backward that would step starts; the walk
through the wrappers is kept per patch (:data:`_PATCHES`).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any

import torch

__all__ = ["PER_PART_MARK", "instance_override"]


#: the attribute, true on a ``step`` patched on the instance, that has it run once per
#: part stepped during backward (as overlapkit's tests count partial steps), by choice
PER_PART_MARK = "overlapkit_per_part"
#: attributes marking the instance ``step`` wrappers that only note the call and step
#: the class's own ``step()``: torch's LR scheduler (it sets ``_opt_called``)
_TRANSPARENT_WRAPPERS = ("_wrapped_by_lr_sched",)


def instance_override(optimizer: torch.optim.Optimizer) -> str | None:
    """``"a step() set on this AdamW (noisy_step) replaces AdamW.step()"`` where the
    loop patched ``step`` on the instance (``optimizer.step = noisy_step``, a wrapper that
    clips, adds noise or counts, then calls the saved ``step``), else None.

    Such a patch is code around the step as an override in a subclass is: the engine
    would run it once per part stepped, on part of the parameters (measured before this
    check, 3 steps of a 40-layer model: gradient noise added in a patch 0.0060 off the
    plain loop, the patch run 9 times instead of 3; learnt, 0.0035 off and 7 times;
    silently). Seen
    through, as the class's own ``step()``: a bound method of it (Accelerate keeps and
    restores one) and torch's LR-scheduler wrapper around it, which only notes the call.
    A patch meant to run per part stepped (a profiler's, a counter of partial steps)
    says so with ``patch.overlapkit_per_part = True`` (:data:`PER_PART_MARK`). Asked as
    each backward that would step starts: a few attribute reads, the walk once per patch
    (:data:`_PATCHES`)."""
    patched = vars(optimizer).get("step") if hasattr(optimizer, "__dict__") else None
    if patched is None or getattr(patched, PER_PART_MARK, False):
        return None
    known, own = _PATCHES.get(optimizer), type(optimizer).step
    if known is not None and known[0]() is patched and known[1] is own:
        return known[2]
    found = _instance_override(optimizer, patched)
    # the same patch asked again at the next backward: answered from here (not kept
    # for an optimizer or a patch without weak references)
    with contextlib.suppress(TypeError):
        _PATCHES[optimizer] = (weakref.ref(patched), own, found)
    return found


#: optimizer -> (a weak reference to the ``step`` patched on it, its class's ``step``,
#: what :func:`instance_override` found): the walk through the wrappers cost 2.8 µs at
#: every backward that would step, while an LR scheduler's patch stays the same object.
#: Weak both ways: a patch holding the optimizer (a closure) keeps nothing alive; a
#: patch replaced (another object) or a class ``step`` replaced is walked again.
_PATCHES: weakref.WeakKeyDictionary[Any, tuple[weakref.ref[Any], Any, str | None]] = (
    weakref.WeakKeyDictionary()
)


def _instance_override(optimizer: torch.optim.Optimizer, patched: Any) -> str | None:
    """:func:`instance_override` of ``patched``, the ``step`` set on ``optimizer``,
    worked out."""
    own = inspect.unwrap(type(optimizer).step)
    function = patched
    for _ in range(8):  # a chain of transparent wrappers, each seen through
        if getattr(function, "__self__", None) is optimizer:
            function = getattr(function, "__func__", function)
        if inspect.unwrap(function) is own and (
            function is type(optimizer).step
            or function is own
            or any(getattr(function, mark, False) for mark in _TRANSPARENT_WRAPPERS)
        ):
            return None
        if not any(getattr(function, mark, False) for mark in _TRANSPARENT_WRAPPERS):
            break
        function = getattr(function, "__wrapped__", None)
        if function is None:
            break
    name = getattr(patched, "__qualname__", None) or type(patched).__qualname__
    cls = type(optimizer).__qualname__
    return f"a step() set on this {cls} ({name}) replaces {cls}.step()"
