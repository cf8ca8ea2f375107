"""Writes through ``.data``, ``numpy()`` or DLPack in the window between backward
and ``step()``: seen.

What the loop changes there is seen by version counters
(:class:`~overlapkit.overlap.core.window.FirstWindow`): every in-place write bumps the
tensor's. A write through ``tensor.data`` does not: ``.data`` is a new tensor on the same
storage with a version counter of its own. Old loops write gradients and parameters that
way (``p.grad.data.mul_(0.5)``, gradient noise ``p.grad.data.add_(...)``,
``p.data.clamp_(-c, c)``, ``p.data = p.data.renorm(...)``); 0.4.0 did not see them
(``overlap_ddp``: SGD 0.030 off after 4 steps of ``p.grad.data.mul_(0.5)``, silently,
with or without ``learn_first_step``; a ``p.data.clamp_`` 0.015 off, warned only as a read).

``torch.Tensor`` gets a ``data`` descriptor (:class:`_Data`, torch's own behind it) when
the first window opens, and keeps it: while a window is open (from the end of a stepping
backward, or of a deferred one in a learnt first window, to ``step()``, ``zero_grad()`` or
the next backward) it notes, for each tensor of the window read or set through it, the ``.data``
tensor handed out and its version, or the values before a set (:class:`DataWrites`): a
later bump of that version, or values not the same after a set (``model.to(device)``
sets ``.data`` to the same tensor; ``model.double().float()`` to the same values: not a
change), is a change of the tensor itself: only the window's parameters, their
gradients, the optimizer's state tensors and tensor settings (:func:`optimizer_tensors`)
are noted. Opening and closing a window cost a list append and removal, 1.6 µs in
all per step with 400 parameters or 1 (the ids are taken at its first ``.data`` only); out
of a window a ``.data`` access costs 0.09 µs more on a tensor, 0.55 µs on a parameter
(measured: 0.33 -> 0.42, 0.29 -> 0.84 µs). Installed once, not per window:
every change to a class's attributes uses up one of its type versions, and past 1000 of
them Python 3.12+ no longer caches attribute lookups on it (measured on 3.13: a method
lookup on a subclass 30% slower after 2000 windows' worth of toggles).

An array handed out by ``numpy()`` or DLPack (``np.from_dlpack``, ``torch.from_dlpack``)
on the memory of one of those tensors writes it without any version counter
(``p.grad.numpy()[...] *= 0.5``: 0.4.0 did not see it, ``overlap_ddp`` SGD 0.0204 off
after 4 steps, silently, 0.0144 learnt). ``torch.Tensor.numpy`` and ``__dlpack__`` are
wrapped the same way, once: in a window, the window's tensors on the same storage have
their values copied (:meth:`DataWrites.note_numpy`, once per tensor and window), and
compared by :meth:`DataWrites.changed`. Out of a window a ``numpy()`` costs 0.27 µs more
(0.70 -> 0.97 µs).

A tensor built over the storage (``torch.tensor([]).set_(p.grad.untyped_storage(),
...)``, ``torch.empty(0).set_(p.grad)``) or the storage itself (``storage.copy_``,
``fill_``) writes without the tensor's version counter too (0.4.0 development: SGD
0.030 off after 4 steps of such a halving under ``optimizer_in_backward``, 0.020 under
``overlap_ddp``, silently also after ``learn_first_step``). ``untyped_storage()`` (behind
``storage()`` as well) and ``set_()`` with a tensor source are noted as ``numpy()`` is
(:func:`_untyped_storage`, :func:`_set`), installed once: out of a window an
``untyped_storage()`` costs 0.025 µs more (0.06 -> 0.085 µs; FSDP2 calls it a few times
per parameter and step), a ``set_()`` 0.25 µs (0.61 -> 0.86 µs). torch's legacy
``to_dlpack`` likewise (:func:`_to_dlpack`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils.dlpack

__all__ = ["DataWrites", "optimizer_tensors", "plain_state", "same_bits"]

#: torch's own ``Tensor.data`` (a C getset descriptor of ``TensorBase``)
_BASE: Any = torch._C.TensorBase.__dict__["data"]
#: the windows open now (usually one; two with two overlapped optimizers)
_OPEN: list[DataWrites] = []


def plain_state(optimizer: Any) -> Any:
    """``optimizer.state``, the dict behind a watched one (read without noting it)."""
    state = optimizer.state
    return getattr(state, "state", state) if type(state) is not dict else state


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors of ``optimizer``'s state (Adam's moments) and of its param groups'
    settings (a tensor ``lr``), which a step reads: a write through their ``.data`` is
    one too (``opt.state[p]["exp_avg"].data.mul_(0.5)``, ``group["lr"].data.fill_(x)``;
    0.4.0: not seen, 0.0055 and 0.039 off after 4 AdamW steps)."""
    if optimizer is None:
        return []
    found = [value for entry in plain_state(optimizer).values() for value in entry.values()
             if isinstance(value, torch.Tensor)]
    found.extend(value for group in optimizer.param_groups for key, value in group.items()
                 if key != "params" and isinstance(value, torch.Tensor))
    return found


class _Data:
    """``torch.Tensor.data`` once a window has opened: torch's, noting the ``.data`` of
    a window's tensors in each open :class:`DataWrites`. Named ``data`` so that a
    watched tensor's ``__torch_function__`` still sees a read of ``.data``
    (:data:`~overlapkit.overlap.core.watched_reads.VALUE_PROPERTIES`)."""

    __name__ = "data"

    def __get__(self, tensor: Any, owner: Any = None) -> Any:
        if tensor is None:
            return self
        alias = _BASE.__get__(tensor)
        for window in _OPEN:
            window.note_alias(tensor, alias)
        return alias

    def __set__(self, tensor: Any, value: Any) -> None:
        for window in _OPEN:
            window.note_set(tensor)
        _BASE.__set__(tensor, value)


_DATA = _Data()
#: torch's own ``Tensor.numpy`` (a C method of ``TensorBase``)
_BASE_NUMPY: Any = torch._C.TensorBase.__dict__["numpy"]


def _numpy(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.Tensor.numpy`` once a window has opened: torch's, noting the tensor in
    each open :class:`DataWrites` (an array on its memory writes it, bumping no version:
    ``p.grad.numpy()[...] *= 0.5``)."""
    for window in _OPEN:
        window.note_numpy(tensor)
    return _BASE_NUMPY(tensor, *args, **kwargs)


_numpy.__name__ = _numpy.__qualname__ = "numpy"  # a watched tensor's reads see its name
_numpy.__doc__ = _BASE_NUMPY.__doc__
#: torch's own ``Tensor.__dlpack__`` (Python, in ``torch._tensor``)
_BASE_DLPACK: Any = torch.Tensor.__dict__.get("__dlpack__")


def _dlpack(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.Tensor.__dlpack__`` once a window has opened: torch's, noting the tensor
    as :func:`_numpy` does (``np.from_dlpack(p.grad)``, ``torch.from_dlpack(p.grad)``:
    an array, or a tensor with a version counter of its own, on its memory)."""
    for window in _OPEN:
        window.note_numpy(tensor)
    return _BASE_DLPACK(tensor, *args, **kwargs)


_dlpack.__name__ = _dlpack.__qualname__ = "__dlpack__"
_dlpack.__doc__ = getattr(_BASE_DLPACK, "__doc__", None)
#: torch's own ``Tensor.untyped_storage`` and ``Tensor.set_`` (C methods of ``TensorBase``)
_BASE_STORAGE: Any = torch._C.TensorBase.__dict__["untyped_storage"]
_BASE_SET: Any = torch._C.TensorBase.__dict__["set_"]


def _untyped_storage(tensor: Any) -> Any:
    """``torch.Tensor.untyped_storage`` once a window has opened: torch's, noting the
    tensor as :func:`_numpy` does (a tensor set on the storage, or the storage's own
    ``copy_`` / ``fill_``, writes its memory bumping no version)."""
    if _OPEN:
        for window in _OPEN:
            window.note_numpy(tensor)
    return _BASE_STORAGE(tensor)


_untyped_storage.__name__ = _untyped_storage.__qualname__ = "untyped_storage"
_untyped_storage.__doc__ = _BASE_STORAGE.__doc__


def _set(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.Tensor.set_`` once a window has opened: torch's, noting a tensor source
    (``torch.empty(0).set_(p.grad)``: a tensor with a version counter of its own on
    its memory) as :func:`_numpy` does."""
    if _OPEN:
        source = args[0] if args else kwargs.get("source")
        if isinstance(source, torch.Tensor):
            for window in _OPEN:
                window.note_numpy(source)
    return _BASE_SET(tensor, *args, **kwargs)


_set.__name__ = _set.__qualname__ = "set_"
_set.__doc__ = _BASE_SET.__doc__
#: torch's own legacy ``to_dlpack`` (``torch.utils.dlpack.to_dlpack``, ``torch.to_dlpack``)
_BASE_TO_DLPACK: Any = torch.utils.dlpack.to_dlpack


def _to_dlpack(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's legacy ``to_dlpack`` once a window has opened: noting the tensor as
    :func:`_numpy` does (``from_dlpack(to_dlpack(p.grad)).mul_(0.5)``: before, SGD
    0.020 off after 4 steps under ``overlap_ddp``, silently). Installed on
    ``torch.utils.dlpack`` and ``torch``: a name imported from them before the first
    window keeps torch's own (not seen)."""
    for window in _OPEN:
        window.note_numpy(tensor)
    return _BASE_TO_DLPACK(tensor, *args, **kwargs)


_to_dlpack.__name__ = _to_dlpack.__qualname__ = "to_dlpack"
_to_dlpack.__doc__ = _BASE_TO_DLPACK.__doc__
#: the wrappers installed on ``torch.Tensor`` once, by name
_WRAPPERS: dict[str, Any] = {"numpy": _numpy, "untyped_storage": _untyped_storage,
                             "set_": _set}
#: the references to a noted ``.data`` tensor when only :class:`DataWrites` holds it
#: (its entry, ``getrefcount``'s argument; ``tests/test_window_data.py`` checks it)
_ONLY_NOTED = 2


def _storage(tensor: torch.Tensor) -> tuple[str, int] | None:
    """Where ``tensor``'s memory is (its device and storage's address), or None for a
    tensor without a storage of its own (a wrapper subclass: FSDP2's ``DTensor``)."""
    try:
        return str(tensor.device), _BASE_STORAGE(tensor).data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _same(before: torch.Tensor, now: torch.Tensor) -> bool:
    if before.dtype != now.dtype or before.shape != now.shape or before.device != now.device:
        return False
    if before.data_ptr() == now.data_ptr() and before.stride() == now.stride():
        return True
    return same_bits(before, now)


def same_bits(before: torch.Tensor, now: torch.Tensor) -> bool:
    """``now`` holds the bits ``before`` held (same dtype and shape assumed): equal
    values, and NaN where NaN was — ``torch.equal`` alone calls a diverged model's
    unchanged NaN values changed (0.4.0 development: a ``numpy()`` read of NaN
    parameters in the window was refused as a write)."""
    if torch.equal(before, now):
        return True
    if not (before.is_floating_point() or before.is_complex()):
        return False
    try:
        return bool(torch.equal(before.reshape(-1).view(torch.uint8),
                                now.reshape(-1).view(torch.uint8)))
    except RuntimeError:  # a tensor whose elements cannot be viewed as bytes
        return False


class DataWrites:
    """The ``.data`` tensors of ``params`` and of their gradients handed out while open,
    and the values of those whose ``.data`` was set: :meth:`changed` says which were
    written through them. Open from construction to :meth:`close` (idempotent); what
    was noted stays for :meth:`changed`. Other tensors (a validation's outputs) are not
    noted, and a ``.data`` tensor that only this holds, unchanged, is dropped at the
    next ``.data`` of the same tensor: a window left open (a backward-only loop's last
    backward) keeps no more than one per tensor."""

    def __init__(self, params: list[torch.Tensor], optimizer: Any = None) -> None:
        self.params, self.optimizer = params, optimizer
        #: ``id`` of the parameters and of their gradients, taken at the first ``.data``
        self._ids: set[int] | None = None
        #: ``id(tensor)`` -> (tensor, [(a ``.data`` of it handed out, its version then)])
        self.aliases: dict[int, tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]] = {}
        #: ``id(tensor)`` -> (tensor, its values before the first set of its ``.data``)
        self.sets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: ``id`` of the tensors seen changed through a ``.data`` no longer kept
        self._changed: set[int] = set()
        #: ``id(tensor)`` -> (tensor, its values when an array on its memory was handed
        #: out: ``numpy()`` of it or of a view of it), and the tensors by storage
        self.arrays: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._storages: dict[tuple[str, int] | None, list[torch.Tensor]] | None = None
        self.open = False
        # another library's own Tensor.data left alone (nothing noted then)
        if torch.Tensor.__dict__.get("data", _DATA) is _DATA:
            if "data" not in torch.Tensor.__dict__:
                torch.Tensor.data = _DATA  # once: see the module docstring
            for name, wrapper in _WRAPPERS.items():
                if name not in torch.Tensor.__dict__:
                    setattr(torch.Tensor, name, wrapper)
            for module in (torch.utils.dlpack, torch):
                if getattr(module, "to_dlpack", None) is _BASE_TO_DLPACK:
                    module.to_dlpack = _to_dlpack  # type: ignore[attr-defined]
            if _BASE_DLPACK is not None and torch.Tensor.__dict__.get(
                    "__dlpack__") is _BASE_DLPACK:
                torch.Tensor.__dlpack__ = _dlpack  # type: ignore[method-assign,assignment]
            _OPEN.append(self)
            self.open = True

    def _noted(self, tensor: torch.Tensor) -> bool:
        if self._ids is None:
            self._ids = {id(p) for p in self.params}
            self._ids.update(id(p.grad) for p in self.params if p.grad is not None)
            self._ids.update(map(id, optimizer_tensors(self.optimizer)))
        return id(tensor) in self._ids

    def note_alias(self, tensor: torch.Tensor, alias: torch.Tensor) -> None:
        if not self._noted(tensor):
            return
        _, kept = self.aliases.setdefault(id(tensor), (tensor, []))
        if any(old._version != version for old, version in kept):
            self._changed.add(id(tensor))
        kept[:] = [entry for entry in kept if entry[0]._version == entry[1]
                   and sys.getrefcount(entry[0]) > _ONLY_NOTED]
        kept.append((alias, alias._version))

    def note_numpy(self, tensor: torch.Tensor) -> None:
        """``tensor.numpy()`` (or ``__dlpack__``): when it shares memory with the
        window's tensors (a gradient, ``p.detach()``, a state tensor), their values now,
        compared by :meth:`changed`. Read past a watched class (no read of the loop's)."""
        with torch._C.DisableTorchFunctionSubclass():
            if self._storages is None:
                self._noted(tensor)  # the ids taken
                self._storages = {}
                tensors = [p for p in self.params] + [p.grad for p in self.params
                                                        if p.grad is not None]
                for found in tensors + optimizer_tensors(self.optimizer):
                    key = _storage(found)
                    if key is not None:
                        self._storages.setdefault(key, []).append(found)
            for found in self._storages.get(_storage(tensor), ()):
                if id(found) not in self.arrays:
                    self.arrays[id(found)] = (found, _BASE.__get__(found).clone())

    def note_set(self, tensor: torch.Tensor) -> None:
        if self._noted(tensor) and id(tensor) not in self.sets:
            self.sets[id(tensor)] = (tensor, _BASE.__get__(tensor))

    def close(self) -> None:
        """Stop noting (idempotent)."""
        if self.open:
            self.open = False
            _OPEN.remove(self)

    def forget(self, tensors: Iterable[torch.Tensor]) -> None:
        """Writes to ``tensors`` are not the loop's (overlapkit's own rewrites)."""
        for tensor in tensors:
            for noted in (self.aliases, self.sets, self.arrays):
                noted.pop(id(tensor), None)
            self._changed.discard(id(tensor))

    def changed(self) -> set[int]:
        """``id`` of each tensor written through ``.data`` (a ``.data`` handed out and
        changed in place since, or ``.data`` set to other values). Empty, at no cost,
        when the loop took no ``.data``."""
        found = set(self._changed)
        found.update(key for key, (_, kept) in self.aliases.items()
                     if any(alias._version != version for alias, version in kept))
        found.update(key for key, (tensor, before) in self.sets.items()
                     if not _same(before, _BASE.__get__(tensor)))
        found.update(key for key, (tensor, before) in self.arrays.items()
                     if not same_bits(before, _BASE.__get__(tensor)))
        return found
