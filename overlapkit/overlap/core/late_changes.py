"""What the loop changed after a backward that stepped, before ``step()``: refused there.

In a loop no integration sets up (or once a learnt loop steps during backward,
:mod:`~overlapkit.overlap.core.window`), the step of a backward is taken during it, so
what the loop changes between that backward and ``step()`` that the plain ``step()``
would have used missed it: a gradient changed or set, a parameter changed in place, a
param-group setting changed (a warm-up, ``lr_scheduler.step()`` called first), the state
reset or one parameter's entry written (:mod:`~overlapkit.overlap.core.state_marks`).
:func:`refuse_changed_gradients` says so at that ``step()``, naming what changed and
``learn_first_step`` (:data:`~overlapkit.overlap.core.window.LEARN`).
:func:`accept_unchanged_rewrites` moves the marks past overlapkit's own rewrites.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.core.group_settings import changed_params
from overlapkit.overlap.core.window import LEARN, FirstWindow, shown_names

__all__ = ["accept_unchanged_rewrites", "refuse_changed_gradients"]


def refuse_changed_gradients(marks: FirstWindow, names: Mapping[int, str],
                             params: list[torch.Tensor], technique: str) -> None:
    """:raises ConfigurationError: the loop changed (or set) a gradient after the
    backward that stepped it, before this ``step()``: the change missed that step.

    Read past the parameters' watched class (:mod:`.watched_params`: freed gradients
    are watched on past ``step()``): a read through it costs about 3 µs a parameter."""
    with torch._C.DisableTorchFunctionSubclass():
        _refuse_changed_gradients(marks, names, params, technique)


def _refuse_changed_gradients(marks: FirstWindow, names: Mapping[int, str],
                              params: list[torch.Tensor], technique: str) -> None:
    learn = "." if marks.learned else f", or keep the loop and call {LEARN} once before it."
    changed = marks.changed_settings() + marks.state_reset()
    dropped = changed_params(changed)
    if dropped:
        raise ConfigurationError(
            f"the parameters of {shown_names(dropped)} "
            "were changed between backward() and optimizer.step() (a parameter removed "
            "from its group, added to it, or the list replaced), after "
            f"{technique} had already stepped the parameters the group held before during "
            "backward, where the plain step takes the group as it is now. The parameters "
            "have taken it: restart from the last checkpoint after fixing the loop. To "
            "stop stepping a parameter (freezing a layer), call requires_grad_(False) on "
            "it before the forward (a parameter without a gradient is not stepped), or "
            "build a new optimizer after optimizer.step() (release() this one first); to "
            f"add parameters, call add_param_group() on the optimizer {technique} "
            "returned")
    if changed:
        raise ConfigurationError(
            f"the optimizer's settings ({shown_names(changed)}) were changed between "
            f"backward() and optimizer.step(), after {technique} had already stepped the "
            "parameters with the values before the change during backward, so the change "
            "missed this step (a hand-written warm-up, or lr_scheduler.step() called before "
            "optimizer.step()). The parameters have taken it: restart from the last "
            "checkpoint after fixing the loop. Change the learning rate and the other "
            "settings before backward() (an LR scheduler stepped after optimizer.step() "
            f"does){learn}"
        )
    written = marks.state_written(names)
    if written:
        raise ConfigurationError(
            f"the optimizer's state of {shown_names(written)} was written between backward() "
            "and optimizer.step() (a moment scaled in place, an entry cleared, replaced "
            f"or deleted), after {technique} had already stepped them during backward "
            "with the state before the write, where the plain step starts from the "
            "written state. The parameters have taken it: restart from the last "
            "checkpoint after fixing the loop. Write the optimizer's state after "
            f"optimizer.step(){learn}")
    moved = marks.moved(names, params)
    if moved:
        raise ConfigurationError(
            f"the values of {shown_names(moved)} were changed in place between backward() and "
            f"optimizer.step() (a clamp, a projection), after {technique} had already "
            "stepped them during backward, where the plain step starts from the changed "
            "values. The parameters have taken it: restart from the last checkpoint "
            f"after fixing the loop. Change parameters after optimizer.step(){learn}")
    edited = marks.edited(names, params)
    if not edited:
        return
    shown = shown_names(edited)
    raise ConfigurationError(
        f"the gradients of {shown} were changed between backward() and "
        f"optimizer.step(), after {technique} had already stepped the parameters "
        "with them during backward, so the change missed this step. The parameters "
        "have taken it: restart from the last checkpoint after fixing the loop. To "
        "change gradients, change them before they are reduced (a gradient hook on "
        f"the parameter, a DDP comm hook){learn}"
    )


def accept_unchanged_rewrites(steps: Any, params: Iterable[torch.Tensor],
                              versions: Mapping[int, int]) -> None:
    """``params`` that overlapkit rewrote in place with their own values (a checkpoint's
    save: torch's ``get_state_dict`` creates state with a zero step), ``versions``: ``id``
    -> their version before. Not a change of the loop's: the marks move past those
    writes only."""
    params = list(params)
    for marks in (steps.stepped_marks, steps.first_window):
        if marks is None:
            continue
        if marks.data_writes is not None:
            marks.data_writes.forget(params)
        for param in params:
            before = versions.get(id(param))
            if before is not None and marks.versions.get(id(param)) == before:
                marks.versions[id(param)] = param._version
