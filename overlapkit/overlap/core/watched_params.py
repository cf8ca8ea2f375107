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
``torch.nn.Parameter`` for that time, and back (no instance attribute is added, so a
copy or a pickle of it taken meanwhile is a plain parameter). Only plain
``torch.nn.Parameter`` objects are watched (not FSDP2's ``DTensor`` parameters). What
reads no values (``.grad``, ``.shape``, ``requires_grad``, ``_version``, registering a
hook) is not a read; overlapkit's own work runs under
:func:`~overlapkit.overlap.core.watched_reads.quiet_reads`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten

from overlapkit.overlap.core.watched_reads import METADATA_METHODS, VALUE_PROPERTIES, quiet

__all__ = ["unwatch_params", "watch_params"]


class _Window(Protocol):
    """What a watched parameter reports to (the first window)."""

    def note_param_read(self, param: torch.Tensor) -> None: ...


#: ``id(param)`` -> the parameter and the window its reads are noted in, while watched
_WATCHED: dict[int, tuple[torch.Tensor, _Window]] = {}
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


class _WatchedParameter(torch.nn.Parameter):
    """A parameter of the first window (the same object, its class switched)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not quiet() and _reads_values(func):
            for arg in tree_flatten((args, kwargs))[0]:
                watched = _WATCHED.get(id(arg)) if isinstance(arg, _WatchedParameter) else None
                if watched is not None and watched[0] is arg:
                    watched[1].note_param_read(arg)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A plain parameter (``copy.deepcopy(model)`` in the window: an EMA's copy), the
        read noted (``.data`` is read on the way)."""
        self.__class__ = torch.nn.Parameter  # type: ignore[assignment]
        try:
            return copy.deepcopy(self, memo)
        finally:
            self.__class__ = _WatchedParameter


def watch_params(params: Iterable[torch.Tensor], window: _Window) -> None:
    """Note reads of the values of ``params`` (those that are plain parameters) in
    ``window`` until :func:`unwatch_params`."""
    for param in params:
        if type(param) is torch.nn.Parameter:
            param.__class__ = _WatchedParameter
        if type(param) is _WatchedParameter:
            _WATCHED[id(param)] = (param, window)


def unwatch_params(window: _Window) -> None:
    """Give the parameters watched for ``window`` back their plain class (before the
    step, or as the next backward starts)."""
    for key, (param, watching) in list(_WATCHED.items()):
        if watching is window:
            del _WATCHED[key]
            if type(param) is _WatchedParameter:
                param.__class__ = torch.nn.Parameter  # type: ignore[assignment]
