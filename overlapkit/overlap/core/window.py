"""The window between backward and ``step()``: what a loop does in it, learned from its
first optimizer step, then honoured in the plain order.

A plain loop can read and change gradients after ``backward()`` and before ``step()``
(gradient noise, masking, per-parameter norms), or run several backwards before one
``step()`` (gradient accumulation written without ``no_sync()``). Stepping during backward
removes that window. In a loop known to call ``step()`` (an Accelerate loop set up by
:func:`overlapkit.integrations.accelerate.prepare`), the facade's
:meth:`~overlapkit.overlap.facade.OverlappedOptimizerFacade.learn_first_step` defers the
first optimizer step (``defer_steps()``'s mechanism: backwards reduce, keep ``.grad``,
step nothing), and :class:`FirstWindow` records what the loop did until ``step()``:

- the backwards that would have stepped (more than one: accumulation);
- each gradient's identity and version counter at the end of each backward (in-place
  changes bump a tensor's version; ``param.grad = ...`` replaces it): a gradient changed
  before ``step()`` shows the loop edits gradients;
- the param groups' hyperparameters at the end of each backward: one changed before
  ``step()`` (a warm-up written there, ``lr_scheduler.step()`` called first) shows the
  plain step takes a value the step in backward could not know;
- a ``clip_grad_norm_`` / ``clip_grad_value_`` the loop ran on the kept gradients (the
  plain loop's own clip, bumping their versions; not an edit, and the full step then
  does not clip again).

At ``step()`` the first step is taken as the plain loop takes it (a full step of the
kept gradients). A loop that used the window keeps every later step in that plain
order, with one warning naming what it did and how to keep the overlap: the run is
the plain run, bitwise. Any other loop steps during backward from its second step on.

In a loop no integration sets up, the step is taken during backward from the first,
so what the loop does in the window that the plain ``step()`` would have used is
refused at that ``step()`` (:func:`refuse_changed_gradients`): a gradient changed or
set, a hyperparameter of a param group changed (a warm-up written before ``step()``,
``lr_scheduler.step()`` called first), a param group added; ``zero_grad()`` there, or
instead of ``step()`` (:func:`zero_grad_in_window_error`, from
:mod:`~overlapkit.overlap.core.step_accounting`). The parameters have taken the step
by then, and the message says so.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_flatten

from overlapkit.errors import ConfigurationError

__all__ = ["FirstWindow", "end_first_window", "kept_graph_refusal", "plain_order_warning",
           "quiet_reads",
           "refuse_changed_gradients", "refuse_changed_settings", "second_backward_refusal",
           "settings", "state", "zero_grad_in_window_error"]


def state(param: torch.Tensor) -> tuple[int, int]:
    """What tells that ``param``'s gradient changed: its identity and version counter."""
    grad = param.grad
    return (0, 0) if grad is None else (id(grad), grad._version)


def _fingerprint(value: Any) -> Any:
    """What tells that a hyperparameter changed: the value, or for a tensor (a tensor
    ``lr``, changed in place by a scheduler) its identity and version counter."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if isinstance(value, (tuple, list)):
        return tuple(_fingerprint(each) for each in value)
    return value


def settings(groups: Iterable[Mapping[str, Any]]) -> list[dict[str, tuple[Any, str]]]:
    """Each param group's hyperparameters as a step read them: ``key -> (fingerprint,
    shown)``; ``params`` and a scheduler's ``initial_lr`` (read by no step) left out."""
    return [{key: (_fingerprint(value), _shown(value)) for key, value in group.items()
             if key not in ("params", "initial_lr")} for group in groups]


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return f"{value.item():g}"
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value)[:40]


#: property reads of a gradient that read no values (``.shape``, ``.dtype``, ...)
_VALUE_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
#: methods of a gradient that read no values
_METADATA = frozenset({"size", "dim", "numel", "stride", "element_size", "is_contiguous",
                       "is_floating_point", "is_complex", "data_ptr", "storage_offset",
                       "__len__", "__hash__", "ndimension", "nelement", "get_device"})
_QUIET = threading.local()


@contextmanager
def quiet_reads() -> Iterator[None]:
    """overlapkit's own reads of watched gradients (the loop's clip answered, the step)
    are not the loop's."""
    before = getattr(_QUIET, "on", False)
    _QUIET.on = True
    try:
        yield
    finally:
        _QUIET.on = before


def _reads_values(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: Tensor.shape.__get__, ...
        return getattr(getattr(func, "__self__", None), "__name__", "") in _VALUE_PROPERTIES
    return name not in _METADATA


class _WatchedGrad(torch.Tensor):
    """A gradient kept in the first window (the same storage and version counter): a
    torch operation reading its values notes the read in its :class:`FirstWindow`."""

    _window: FirstWindow
    _name: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not getattr(_QUIET, "on", False) and _reads_values(func):
            for arg in tree_flatten((args, kwargs))[0]:
                if isinstance(arg, _WatchedGrad):
                    arg._window.note_read(arg._name)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


@attrs.define
class FirstWindow:
    """What the loop did between backward and ``step()`` while steps are deferred to learn
    it (see the module docstring)."""

    #: backwards that would have stepped (not inside ``no_sync()`` / ``no_step()``)
    backwards: int = 0
    #: ``id(param)`` -> ``(id(grad), grad._version)`` at the end of the last backward
    marks: dict[int, tuple[int, int]] = attrs.field(factory=dict)
    #: the loop clipped the kept gradients itself (torch's clip, in place)
    clipped: bool = False
    #: the loop has been found to use the window: every step stays in the plain order
    plain_order: bool = False
    #: ``id(param)`` -> name, when the loop reading a gradient uses the window too (the
    #: technique frees it, or clips it during backward): the kept gradients are then
    #: watched (:class:`_WatchedGrad`) until ``step()``; None: reads are not watched
    watching: dict[int, str] | None = None
    #: the names of the gradients the loop read
    read: list[str] = attrs.field(factory=list)
    #: the param groups' hyperparameters the marked backward stepped with
    #: (:func:`settings`), or None when not recorded
    stepped_with: list[dict[str, tuple[Any, str]]] | None = None
    #: the optimizer's live ``param_groups`` (the first window: compared at ``step()``)
    groups: list[dict[str, Any]] | None = None
    #: the loop's first step was learned (``learn_first_step``): its refusals do not
    #: suggest it
    learned: bool = False
    #: ``(id, len)`` of the optimizer's ``state`` the marked backward stepped, and that
    #: optimizer: a state reset or replaced before ``step()`` shows (not a clear of one
    #: parameter's entry: that would cost a look-up per parameter and backward)
    state_seen: tuple[int, int] | None = None
    optimizer: Any = None

    def mark(self, params: Iterable[torch.Tensor]) -> None:
        """Record the gradients of ``params`` as they are now (end of a backward, or
        right after the loop's own clip); watch their reads where asked."""
        for param in params:
            grad = param.grad
            if (self.watching is not None and grad is not None
                    and not isinstance(grad, _WatchedGrad)):
                watched = grad.as_subclass(_WatchedGrad)
                watched._window = self
                watched._name = self.watching.get(
                    id(param), f"a parameter of shape {tuple(param.shape)}")
                param.grad = watched
            self.marks[id(param)] = state(param)

    def changed_settings(self, groups: list[dict[str, Any]]) -> list[str]:
        """``param_groups[i]['key'] (a -> b)`` for each hyperparameter changed since
        :attr:`stepped_with` was recorded."""
        if self.stepped_with is None:
            return []
        found = []
        state = None if self.optimizer is None else self.optimizer.state
        if state is not None and (id(state), len(state)) != self.state_seen:
            found.append(f"optimizer.state ({(self.state_seen or (0, 0))[1]} entries -> "
                         f"{len(state)}, a reset)")
        if len(groups) != len(self.stepped_with):  # add_param_group: its parameters
            found.append(f"param_groups ({len(self.stepped_with)} groups -> {len(groups)})")
        for index, (was, now) in enumerate(zip(self.stepped_with, settings(groups),
                                               strict=False)):
            for key, (fingerprint, shown) in was.items():
                after = now.get(key)
                if after is None or after[0] != fingerprint:
                    found.append(f"param_groups[{index}][{key!r}] ({shown} -> "
                                 f"{'removed' if after is None else after[1]})")
        return found

    def note_read(self, name: str) -> None:
        if name not in self.read:
            self.read.append(name)

    def unwatch(self, params: Iterable[torch.Tensor]) -> None:
        """Put the plain gradients back (before the step reads them); stop watching."""
        self.watching = None
        for param in params:
            grad = param.grad
            if isinstance(grad, _WatchedGrad):
                param.grad = grad.as_subclass(torch.Tensor)

    def clipped_by_loop(self, param: torch.Tensor, before: tuple[int, int]) -> None:
        """The loop's clip rewrote ``param``'s gradient (in place), which was ``before``
        (:func:`state`) then: not an edit, unless it had been edited before the clip."""
        if self.marks.get(id(param)) == before:
            self.mark([param])

    def edited(self, named: dict[int, str], params: Iterable[torch.Tensor]) -> list[str]:
        """The names of ``params`` whose gradient changed since it was marked."""
        found = []
        for param in params:
            if id(param) in self.marks and self.marks[id(param)] != state(param):
                found.append(named.get(id(param), f"a parameter of shape {tuple(param.shape)}"))
        return found

    def reset(self) -> None:
        """A new optimizer step starts (after ``step()``)."""
        self.backwards, self.marks, self.clipped = 0, {}, False


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


def end_first_window(steps: Any, names: Mapping[int, str], params: list[torch.Tensor],
                     technique: str) -> bool:
    """At ``step()`` while the facade's ``learn_first_step`` defers: decide whether the
    loop keeps the plain order (warned once), and whether it clipped the kept gradients
    itself (the full step then does not clip again); returns the latter.

    :param steps: the facade's :class:`~overlapkit.overlap.facade.BackwardSteps`.
    """
    window = steps.first_window
    assert window is not None
    clipped = window.clipped
    if not window.plain_order:
        used = []
        if window.backwards > 1:
            used.append(f"{window.backwards} backwards ran before one optimizer.step() "
                        "(gradient accumulation outside accelerator.accumulate)")
        edited = window.edited(dict(names), params)
        if edited:
            shown = ", ".join(edited[:3]) + (" and others" if len(edited) > 3 else "")
            used.append(f"the gradients of {shown} were changed")
        changed = window.changed_settings(window.groups or [])
        if changed:  # the deferred step takes the new value, as the plain step() does
            shown = ", ".join(changed[:3]) + (" and others" if len(changed) > 3 else "")
            used.append(f"{shown} changed (a warm-up before step(), or the scheduler "
                        "stepped first)")
        read = [name for name in window.read if name not in edited]
        if read:
            shown = ", ".join(read[:3]) + (" and others" if len(read) > 3 else "")
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
        steps.first_window = None
        steps.learned = True
        steps.deferring = False
        steps.deferred()
        steps.calls_step = True
    return clipped


#: what a hand-written loop that works in the window calls to have it honoured
LEARN = ("optimizer.learn_first_step(model) (the first step is then taken at "
         "optimizer.step() and shows the loop uses this window: every step stays there, "
         "in the plain order, bitwise the plain loop, with one warning)")


def refuse_changed_gradients(marks: FirstWindow, names: Mapping[int, str],
                             params: list[torch.Tensor], technique: str,
                             groups: list[dict[str, Any]]) -> None:
    """:raises ConfigurationError: the loop changed (or set) a gradient after the
    backward that stepped it, before this ``step()``: the change missed that step; or
    it changed a hyperparameter of ``groups`` (:func:`refuse_changed_settings`)."""
    edited = marks.edited(dict(names), params)
    if not edited:
        refuse_changed_settings(marks, groups, technique)
        return
    shown = ", ".join(edited[:3]) + (" and others" if len(edited) > 3 else "")
    raise ConfigurationError(
        f"the gradients of {shown} were changed between backward() and "
        f"optimizer.step(), after {technique} had already stepped the parameters "
        "with them during backward, so the change missed this step. The parameters "
        "have taken it: restart from the last checkpoint after fixing the loop. To "
        "change gradients, change them before they are reduced (a gradient hook on "
        "the parameter, a DDP comm hook)"
        + ("." if marks.learned else f", or keep the loop and call {LEARN} once before it.")
    )


def refuse_changed_settings(marks: FirstWindow, groups: list[dict[str, Any]],
                            technique: str) -> None:
    """:raises ConfigurationError: the loop changed a hyperparameter of a param group
    (``lr``, ``weight_decay``, ``betas``, ``momentum``: a hand-written warm-up, or
    ``lr_scheduler.step()`` called before ``optimizer.step()``) after the backward that
    stepped with the old value, before this ``step()``, which the plain loop would have
    taken with the new one."""
    changed = marks.changed_settings(groups)
    if not changed:
        return
    shown = ", ".join(changed[:3]) + (" and others" if len(changed) > 3 else "")
    raise ConfigurationError(
        f"{shown} changed between backward() and optimizer.step(), after {technique} "
        "had already stepped the parameters with the old value during backward, where "
        "the plain step() would use the new one (measured: 0.015 off the plain loop "
        "after 3 steps of a hand-written warm-up). A learning-rate warm-up written "
        "before optimizer.step(), or lr_scheduler.step() called before "
        "optimizer.step(), does this. Change hyperparameters before backward() (before "
        "the forward, as at the top of the loop), and call lr_scheduler.step() after "
        "optimizer.step(), the order torch documents"
        + ("" if marks.learned else f", or keep the loop and call {LEARN} once before it")
        + ". The parameters have taken this step: restart from the last checkpoint after "
        "fixing the loop."
    )


def zero_grad_in_window_error(technique: str) -> ConfigurationError:
    """The error of ``zero_grad()`` after a backward that stepped, before ``step()`` (or
    instead of it: a loop skipping a step, e.g. on a non-finite norm): the plain loop
    takes no step with that backward's gradients (after ``zero_grad()`` its ``step()``
    steps cleared ones: nothing, or zeros that still move momentum), where
    ``technique`` has stepped with them."""
    return ConfigurationError(
        "optimizer.zero_grad() was called after a backward and before optimizer.step() "
        "(or instead of it, skipping this step): the plain loop would take no step with "
        f"this backward's gradients, but {technique} had already stepped the parameters "
        "with them during backward. Call zero_grad() after step() (or before "
        "backward()); to skip a step (a non-finite gradient norm), have the optimizer "
        "decide during backward (grad_scaler= skips a step with an inf or NaN on any "
        "rank). The parameters have taken that step: restart from the last checkpoint "
        "after fixing the loop."
    )


def second_backward_refusal(steps: Any, error: BaseException) -> ConfigurationError | None:
    """The error for autograd's ``error`` from a backward through a graph kept with
    ``retain_graph=True`` whose saved parameters the previous backward's step changed in
    place (a second backward before ``step()``: an auxiliary loss, adversarial
    training), or None when it is something else. Autograd raises before any of the
    technique's hooks see that backward (measured on torch 2.13: the parameters are
    unchanged by it), so the step-accounting refusal of a second backward never runs.
    (:mod:`~overlapkit.overlap.core.kept_graph` raises it first where the graph's output
    is the model's.)

    :param steps: the facade's :class:`~overlapkit.overlap.facade.BackwardSteps`.
    """
    if not (isinstance(error, RuntimeError) and steps.stepped_since_step
            and "modified by an inplace operation" in str(error)):
        return None
    return kept_graph_refusal(steps)


def kept_graph_refusal(steps: Any) -> ConfigurationError:
    """The error of a second backward before ``step()`` through a graph kept with
    ``retain_graph=True``, after a backward that stepped the parameters it saved."""
    return ConfigurationError(
        f"backward() ran again before optimizer.step(), through a graph kept with "
        f"retain_graph=True, after the previous backward had stepped the parameters "
        f"that graph saved: {steps.technique} steps during backward, so every backward is "
        "one optimizer step, and autograd cannot run the second (its saved parameters "
        "were changed in place). Nothing was stepped in this backward; the parameters "
        "have taken the first one's step. Sum the losses into one backward "
        f"(loss + aux_loss), or run all but the last backward {steps.accumulate}; "
        "restart from the last checkpoint after fixing the loop."
    )
