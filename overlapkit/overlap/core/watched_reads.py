"""Noticing the loop's reads in the first window: of a kept gradient, of the optimizer's
``state``.

While :meth:`~overlapkit.overlap.facade.OverlappedOptimizerFacade.learn_first_step`
defers the first step, a loop that reads a gradient between backward and ``step()``
uses the window when the technique would free that gradient, or clip it, during later
backwards (:mod:`~overlapkit.overlap.core.window`). The gradient is watched until
``step()``: a torch operation reading its values notes the read in its window. The
gradient object itself switches its class to a watched subclass of its own
(:class:`_WatchedGrad` for a plain tensor; FSDP2's ``DTensor`` gradients alike) for that
time, and back: the same object, not a view of it, so that what torch refuses on a
view works as in the plain loop (``p.grad.detach_()``, a hand-written ``zero_grad``,
torch's ``zero_grad(set_to_none=False)`` of a gradient made with ``create_graph=True``;
before the thirteenth round the gradient was replaced by an ``as_subclass`` view, and
kept as one after ``step()``, where ``detach_()`` raised torch's "Can't detach views
in-place"). The optimizer's ``state`` is wrapped in :class:`WatchedState`, the same
dict behind it.

overlapkit's own reads (the loop's clip answered, the step) run under
:func:`quiet_reads`.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["METADATA_METHODS", "VALUE_PROPERTIES", "WatchedState", "is_watched",
           "loop_stacklevel", "quiet", "quiet_reads", "run_noting", "unwatch_grad",
           "watch_grad"]


class _Window(Protocol):
    """What a watched gradient or state reports to (the first window)."""

    state_read: bool

    def note_read(self, name: str) -> None: ...


#: the properties of a tensor whose read reads its values (not ``.shape``, ``.dtype``, ...)
VALUE_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
#: methods of a tensor that read no values
METADATA_METHODS = frozenset({"size", "dim", "numel", "stride", "element_size",
                              "is_contiguous", "is_floating_point", "is_complex", "data_ptr",
                              "storage_offset", "__len__", "__hash__", "ndimension",
                              "nelement", "get_device"})
_QUIET = threading.local()
#: where overlapkit's and torch's modules are (their frames are not the loop's)
_NOT_THE_LOOP = (str(Path(__file__).resolve().parents[2]) + os.sep,
                 str(Path(torch.__file__).resolve().parent) + os.sep)


def loop_stacklevel() -> int:
    """The ``stacklevel`` that has a warning raised by the caller of this function point
    at the loop's line that read (``opt.state[p]``, ``ema.update_parameters(model)``):
    past overlapkit's and torch's frames and ``collections.abc``'s mixins
    (``opt.state.items()``)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(_NOT_THE_LOOP)
                                        or "_collections_abc" in frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def quiet() -> bool:
    """Whether overlapkit's own reads are running (:func:`quiet_reads`)."""
    return bool(getattr(_QUIET, "on", False))


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
        return getattr(getattr(func, "__self__", None), "__name__", "") in VALUE_PROPERTIES
    return name not in METADATA_METHODS


class _WatchesReads:
    """What every watched gradient class shares: a torch operation reading the values of
    one notes it in that gradient's window, then runs as it would have."""

    _window: _Window
    _name: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return run_noting(func, args, kwargs, _reads_values, _note_grad_read)


def _note_grad_read(arg: Any) -> None:
    if isinstance(arg, _WatchesReads):
        arg._window.note_read(arg._name)


def run_noting(func: Any, args: Any, kwargs: Any, reads_values: Callable[[Any], bool],
               note: Callable[[Any], None]) -> Any:
    """Run the torch operation ``func`` as a watched tensor's ``__torch_function__``:
    unless overlapkit's own reads are running (:func:`quiet_reads`), ``note`` each of its
    arguments first when ``reads_values(func)``; the operation itself runs on the plain
    tensors' implementation."""
    kwargs = kwargs or {}
    if not quiet() and reads_values(func):
        for arg in tree_flatten((args, kwargs))[0]:
            note(arg)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class _WatchedGrad(_WatchesReads, torch.Tensor):
    """A plain gradient kept in the first window (the same object, its class switched
    for that time)."""

    _unwatched_class = torch.Tensor


#: tensor subclass -> its watched subclass (:func:`_watched_class`)
_WATCHED_CLASSES: dict[type, type] = {torch.Tensor: _WatchedGrad}


def _watched_class(cls: type) -> type:
    """The watched subclass of the tensor subclass ``cls`` (one per class)."""
    watched = _WATCHED_CLASSES.get(cls)
    if watched is None:
        watched = type(f"_Watched{cls.__name__}", (_WatchesReads, cls),
                       {"_unwatched_class": cls})
        _WATCHED_CLASSES[cls] = watched
    return watched


def is_watched(grad: torch.Tensor | None) -> bool:
    return isinstance(grad, _WatchesReads)


def watch_grad(param: torch.Tensor, window: _Window, name: str) -> None:
    """Watch the reads of ``param``'s gradient (not None, not watched) until
    :func:`unwatch_grad`."""
    watched: Any = param.grad
    assert watched is not None
    watched.__class__ = _watched_class(type(watched))  # the same object, watched a while
    watched._window, watched._name = window, name


def unwatch_grad(param: torch.Tensor) -> None:
    """Give ``param`` back the gradient :func:`watch_grad` watched (before the step reads
    it)."""
    grad: Any = param.grad
    if isinstance(grad, _WatchesReads):
        grad.__class__ = type(grad)._unwatched_class  # type: ignore[attr-defined]
        del grad._window, grad._name


class WatchedState(MutableMapping[Any, Any]):
    """The optimizer's ``state`` between a backward and ``step()`` (in the first window,
    or after a stepping backward: :class:`~overlapkit.overlap.core.state_marks.StateWrites`):
    the same dict behind it; the loop reading it (or writing) is noted in the window."""

    def __init__(self, state: MutableMapping[Any, Any], window: _Window) -> None:
        self.state, self.window = state, window

    def _note(self) -> MutableMapping[Any, Any]:
        if not quiet():
            self.window.state_read = True
        return self.state

    def __getitem__(self, key: Any) -> Any:
        return self._note()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._note()[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._note()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._note())

    def __len__(self) -> int:
        return len(self._note())

    def __contains__(self, key: object) -> bool:
        return key in self._note()  # not through __getitem__ (a defaultdict's insert)

    def __repr__(self) -> str:
        return repr(self._note())

    def __copy__(self) -> Any:
        return copy.copy(self._note())  # the dict's copy, not a second watch

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self._note(), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._note().__reduce_ex__(protocol)  # pickled as the dict

    def __getattr__(self, name: str) -> Any:
        """The dict's other attributes (``default_factory``), as on the dict."""
        if name in ("state", "window"):
            raise AttributeError(name)
        return getattr(self._note(), name)
