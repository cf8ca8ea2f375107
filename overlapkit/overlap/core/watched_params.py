"""Noticing the loop's reads of the parameters in the first window (an EMA's
``update_parameters``, a copy of the model, a logged weight norm).

A plain loop that reads the parameters between ``backward()`` and ``step()`` reads the
last step's values; from its second step on, a technique that steps during backward
would have it read this step's, silently. While
:meth:`~overlapkit.overlap.facade.OverlappedOptimizerFacade.learn_first_step` defers the
first step, the parameters the optimizer steps are watched from the end of each backward
until ``step()`` (or the next backward: a read between two backwards of one step, the
next micro-batch's forward, sees the same values either way): a torch operation that
reads the values of one notes it in the window
(:class:`~overlapkit.overlap.core.window.FirstWindow`), which then keeps every step in
the plain order.

A watched parameter is the same object: its class is switched to a watched subclass of
``torch.nn.Parameter`` (one per watcher, which holds the window) for that time, and back
(no instance attribute is added, so a copy or a pickle of it taken meanwhile is a plain
parameter). A ``DTensor`` parameter (FSDP2's) is switched to a watched subclass of
``DTensor`` the same way. What
reads no values (``.grad``, ``.shape``, ``requires_grad``, ``_version``, registering a
hook) is not a read; overlapkit's own work runs under
:func:`~overlapkit.overlap.core.watched_reads.quiet_reads`.
"""

from __future__ import annotations

import copy
import os
import sys
import sysconfig
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from overlapkit.overlap.core.read_warnings import (
    freed_gradient_read_warning,
    loop_frame,
    parameter_read_warning,
    read_after_step_warning,
    warn_at,
)
from overlapkit.overlap.core.watched_reads import (
    _NOT_THE_LOOP,
    METADATA_METHODS,
    VALUE_PROPERTIES,
    loop_stacklevel,
    quiet,
    run_noting,
)

__all__ = ["FreedGradientReadWarning", "ParameterReadInWindowWarning", "ParameterReads",
           "finish_after_step", "unwatch_params", "watch_params", "watched_class"]


class _Window(Protocol):
    """What a watched parameter reports to (the first window)."""

    def note_param_read(self, param: torch.Tensor) -> None: ...


#: methods of a parameter that read no values: bookkeeping a loop or a framework does
#: between backward and ``step()``
_BOOKKEEPING = METADATA_METHODS | {"register_hook", "register_post_accumulate_grad_hook",
                                   "requires_grad_", "retain_grad", "__setstate__"}


def _reads_values(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__set__", "__delete__"):  # param.grad = ..., set by hand: not a read
        return False
    if name == "__get__":  # a property: Tensor.grad.__get__, Tensor.data.__get__, ...
        return getattr(getattr(func, "__self__", None), "__name__", "") in VALUE_PROPERTIES
    return name not in _BOOKKEEPING


def _note_read(arg: Any) -> None:
    window = type(arg)._window if isinstance(arg, _WatchesParameterReads) else None
    if window is not None:
        window.note_param_read(arg)


def _reads_grad(func: Any) -> bool:
    """``func`` is ``Tensor.grad.__get__`` (``param.grad`` read)."""
    return (getattr(func, "__name__", "") == "__get__"
            and getattr(getattr(func, "__self__", None), "__name__", "") == "grad")


class _WatchesParameterReads:
    """What every watched parameter class shares (a plain parameter's, a ``DTensor``
    parameter's): a torch operation reading its values notes it in the class's
    ``_window``, then runs as it would have."""

    _window: _Window | None = None
    #: the class the parameter has when not watched
    _unwatched_class: type = torch.nn.Parameter

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        found = run_noting(func, args, kwargs, _reads_values, _note_read)
        if found is None and _reads_grad(func) and not quiet():  # a freed gradient
            note = getattr(cls._window, "note_grad_read", None)
            if note is not None:
                note()
        return found

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A plain parameter (``copy.deepcopy(model)`` in the window: an EMA's copy), the
        read noted."""
        watched = type(self)
        if watched._window is not None and not quiet():
            watched._window.note_param_read(self)  # type: ignore[arg-type]
        if type(self) is not watched:  # the read stopped watching it
            return copy.deepcopy(self, memo)
        self.__class__ = watched._unwatched_class
        try:
            return copy.deepcopy(self, memo)
        finally:
            self.__class__ = watched


class _WatchedParameter(_WatchesParameterReads, torch.nn.Parameter):
    """A plain parameter of a window (the same object, its class switched to a subclass
    of this one per watcher, :func:`watched_class`, whose ``_window`` the reads go to).
    A parameter of a tensor subclass (FSDP2's ``DTensor``) is switched to a subclass of
    its own class per watcher instead (:func:`_subclass_for`)."""

    #: the watched subclass of each tensor subclass, for this watcher
    _subclasses: ClassVar[dict[type, type]] = {}


def watched_class() -> type[_WatchedParameter]:
    """A class of watched parameters, for one watcher (an optimizer's, a window's): what
    :func:`watch_params` switches parameters to (made once per watcher: about 9 µs)."""
    return type("_WatchedParameter", (_WatchedParameter,), {"_subclasses": {}})


def _subclass_for(watched: type[_WatchedParameter], cls: type) -> type:
    """The watched class of a parameter of tensor subclass ``cls`` (FSDP2's ``DTensor``,
    which 0.4.0 did not watch: an EMA over it 0.010 off the plain loop's, not warned
    of) for ``watched``'s watcher, made once."""
    sub = watched._subclasses.get(cls)
    if sub is None:
        sub = type(f"_Watched{cls.__name__}", (_WatchesParameterReads, cls),
                   {"_unwatched_class": cls})
        watched._subclasses[cls] = sub
    return sub


def _watchable(param: torch.Tensor) -> bool:
    """A plain parameter, or a parameter of a wrapper subclass (``DTensor``) that is not
    watched already."""
    cls = type(param)
    return cls is torch.nn.Parameter or (
        getattr(param, "_is_param", False) and not issubclass(cls, _WatchesParameterReads)
        and cls.__torch_function__ is torch._C._disabled_torch_function_impl)


def watch_params(params: Iterable[torch.Tensor], watched: type[_WatchedParameter],
                 window: _Window) -> None:
    """Note reads of the values of ``params`` (plain parameters, and ``DTensor`` ones) in
    ``window`` until :func:`unwatch_params`: their class switched to ``watched`` (or to
    its subclass of theirs)."""
    watched._window = window
    for sub in watched._subclasses.values():
        sub._window = window  # type: ignore[attr-defined]
    for param in params:
        cls = type(param)
        if cls is torch.nn.Parameter:
            param.__class__ = watched
        elif _watchable(param):
            sub = _subclass_for(watched, cls)
            sub._window = window  # type: ignore[attr-defined]
            param.__class__ = sub


def unwatch_params(params: Iterable[torch.Tensor], watched: type[_WatchedParameter]) -> None:
    """Give ``params`` watched as ``watched`` back their own class (before the step, or
    as the next backward starts); reads of a parameter left so go nowhere."""
    watched._window = None
    subclasses = set(watched._subclasses.values())
    for sub in subclasses:
        sub._window = None  # type: ignore[attr-defined]
    for param in params:
        cls = type(param)
        if cls is watched or cls in subclasses:
            param.__class__ = cls._unwatched_class  # type: ignore[attr-defined]


class ParameterReadInWindowWarning(UserWarning):
    """The loop read the parameters between a stepping backward and ``step()``: they
    hold this step's update already, the plain loop's the last step's."""


class FreedGradientReadWarning(UserWarning):
    """The loop read ``.grad`` of parameters ``optimizer_in_backward`` had stepped and
    freed, between that backward and ``step()``: None, where the plain loop's hold the
    gradients; a change of them there (noise, masking, a scale) was not in the step. Or
    after ``step()``, before ``zero_grad()``, where the plain loop's still hold them (an
    LR scheduler reading them)."""


#: the optimizers (or step accounts) whose loop was warned, once each (of freed
#: gradients read: or no longer watched for them)
_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()
_GRADS_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()
#: ``owner`` -> its :class:`ParameterReads` watching freed gradients past ``step()``
_AFTER_STEP: weakref.WeakKeyDictionary[Any, ParameterReads] = weakref.WeakKeyDictionary()
#: ``owner`` -> its class of watched parameters (:class:`ParameterReads`)
_CLASSES: weakref.WeakKeyDictionary[Any, type[_WatchedParameter]] = (
    weakref.WeakKeyDictionary())


#: where installed packages are: a trainer's own look at the gradients there (the
#: Hugging Face Trainer's check of their meshes, once per optimizer) is no loop's edit
#: in a ``first`` window (:class:`ParameterReads`), where such a look runs uncached
INSTALLED = tuple({sysconfig.get_paths()[key] + os.sep for key in ("purelib", "platlib")})


class ParameterReads:
    """The parameters a backward stepped, from its end to ``step()`` (or the next
    backward, a ``zero_grad()``), in a loop known to call ``step()``: the loop's first
    read of their values there is warned of (:class:`ParameterReadInWindowWarning`),
    once per ``owner`` (the optimizer). ``freed``: the backward freed their gradients
    (``optimizer_in_backward``): reads of ``.grad`` that find None are counted, and
    warned of as the window closes (:class:`FreedGradientReadWarning`, once per
    ``owner``) unless a clip of the parameters with a gradient, answered for the freed
    ones (:func:`~overlapkit.overlap.rules.clip_halves.given_or_freed`), was what read
    them (:meth:`answered`). Nothing is watched once both were warned of, nor for
    gradients after a window without such a read once the values were warned of (a
    loop reading them every step would pay for the watching every step: a gradient
    edit it starts later is not seen).
    Watching costs two class switches per parameter and step (about 0.15 µs for both on
    the 2-core test machine), and nothing to an operation that does not touch a
    parameter.

    ``first``: the first stepping backward of a loop not known yet to call ``step()``
    (a backward-only loop's next forward reads the values, and its gradients are None
    in the plain fused loop too): both reads are warned of only when the loop's
    ``step()`` ends the window (:meth:`release` ``at_step``), pointing at the read
    (of the gradients, only from frames outside installed packages: :data:`INSTALLED`) —
    before, a loop's first step was watched for neither (a defensive gradient edit
    skipped there, an EMA one step ahead), warned of at its second ``step()``.

    Past ``step()``, freed gradients not read before are watched on until
    ``zero_grad()``, the next backward or any module's forward (:meth:`finish`): the
    plain loop still holds them there (an LR scheduler or a log reading them after
    ``step()``: before, silently None). The parameters keep the watched class for that
    time, usually nothing between ``step()`` and ``zero_grad()``; a forward pre-hook,
    registered and removed per step while the gradients are watched, costs 0.93 µs."""

    def __init__(self, params: list[torch.Tensor], technique: str, owner: Any,
                 freed: bool = False, first: bool = False) -> None:
        self.technique, self.owner, self.params = technique, owner, params
        self.watched: type[_WatchedParameter] | None = None
        self.values = owner not in _WARNED
        self.grads = freed and owner not in _GRADS_WARNED
        #: reads of a freed ``.grad`` not answered by a clip, and the first one's frame
        self.grad_reads = 0
        self.first_read: Any = None
        #: ``first``, and the frame of the first read of the values there
        self.first = first
        self.value_read: tuple[str, int, dict[str, Any]] | None = None
        self._forward_hook: Any = None
        #: watching freed gradients past ``step()`` (:meth:`finish` ends it)
        self.after_step = False
        if self.values or self.grads:
            self.watched = _CLASSES.get(owner)
            if self.watched is None:
                self.watched = _CLASSES[owner] = watched_class()
            watch_params(params, self.watched, self)
            if first:  # a backward-only loop's next forward runs on the plain class
                self._forward_hook = register_module_forward_pre_hook(self._forward_starts)

    def note_param_read(self, param: torch.Tensor) -> None:
        if not self.values:
            return
        self.values = False
        if not self.grads:
            self._unwatch()
        if self.first:  # warned of by the step() ending this window, if one does
            if not quiet():
                self.value_read = loop_frame()
            return
        if self.owner not in _WARNED:
            _WARNED.add(self.owner)
            warnings.warn(parameter_read_warning(self.technique),
                          ParameterReadInWindowWarning, stacklevel=loop_stacklevel())

    def note_grad_read(self) -> None:
        """``.grad`` of a watched parameter read, None (freed)."""
        # the frame reading: the loop's, not overlapkit's or torch's own (a clip answered)
        reader = sys._getframe(2).f_code.co_filename
        if self.grads and not reader.startswith(_NOT_THE_LOOP) and not (
                self.first and reader.startswith(INSTALLED)):
            self.grad_reads += 1
            if self.first_read is None:
                self.first_read = loop_frame()

    def answered(self) -> None:
        """A clip of the parameters with a gradient (``[p for p in params if p.grad is
        not None]``, one read of each) was answered for the freed ones: not a skipped
        change."""
        self.grad_reads = max(0, self.grad_reads - len(self.params))
        if not self.grad_reads:
            self.first_read = None

    def _forward_starts(self, module: Any, args: Any) -> None:
        """A module's forward starts in a ``first`` window or after ``step()``: the next
        iteration's, or a validation's; the parameters go back to their plain class
        before it runs (a compiled forward would otherwise be compiled again for the
        watched class)."""
        if self.after_step:
            self.finish()
        else:
            self._unwatch()

    def _unwatch(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        if self.watched is not None and self.watched._window is self:
            unwatch_params(self.params, self.watched)

    def release(self, at_step: bool = False) -> None:
        """Give the parameters back their plain class (``step()``: ``at_step``, the next
        backward), and warn of the freed gradients read, once. At ``step()``, freed
        gradients not read before are watched on until :meth:`finish`."""
        if self.after_step:  # watched on past step(): finish() ends it
            return
        reads, frame, self.grad_reads, self.first_read = (
            self.grad_reads, self.first_read, 0, None)
        if self.first:  # the loop's shape known only from a step() ending the window
            value_read, self.value_read = self.value_read, None
            if not at_step:
                self._unwatch()
                return
            self.first = False
            if value_read is not None and self.owner not in _WARNED:
                _WARNED.add(self.owner)
                warn_at(value_read, parameter_read_warning(self.technique),
                        ParameterReadInWindowWarning)
        if reads and self.owner not in _GRADS_WARNED:
            _GRADS_WARNED.add(self.owner)
            self.grads = False
            warn_at(frame, freed_gradient_read_warning(self.technique, reads),
                    FreedGradientReadWarning)
        if at_step and self.grads:  # read after step(), where the plain loop keeps them
            self.after_step, self.values = True, False  # step()'s own checks read past
            _AFTER_STEP[self.owner] = self  # the class (late_changes), unnoted
            if self._forward_hook is None:
                self._forward_hook = register_module_forward_pre_hook(self._forward_starts)
            return
        self._unwatch()
        self._stop_watching_grads(reads)

    def finish(self) -> None:
        """End the watching past ``step()`` (``zero_grad()``, the next backward or
        forward: :func:`finish_after_step`), and warn of the freed gradients read
        there, once."""
        if not self.after_step:
            return
        self.after_step = False
        if _AFTER_STEP.get(self.owner) is self:
            del _AFTER_STEP[self.owner]
        self._unwatch()
        reads, frame, self.grad_reads, self.first_read = (
            self.grad_reads, self.first_read, 0, None)
        if reads and self.owner not in _GRADS_WARNED:
            _GRADS_WARNED.add(self.owner)
            self.grads = False
            warn_at(frame, read_after_step_warning(self.technique, reads),
                    FreedGradientReadWarning)
        self._stop_watching_grads(reads)

    def _stop_watching_grads(self, reads: int) -> None:
        if self.grads and not reads and self.owner in _WARNED:
            # a loop reading the values there (an EMA, a validation forward) is not
            # watched on after a window without a freed gradient read: its operations
            # on the parameters would go through the watched class every step
            _GRADS_WARNED.add(self.owner)


def finish_after_step(owner: Any) -> None:
    """``zero_grad()`` or the next backward of ``owner``'s loop (the step account's
    ``release_state``): the freed gradients watched past ``step()`` no longer are."""
    reads = _AFTER_STEP.get(owner)
    if reads is not None:
        reads.finish()
