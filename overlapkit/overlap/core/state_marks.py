"""What tells that the loop wrote the optimizer's state between a stepping backward and
``step()``: each parameter's state entry, its values' identities and version counters,
marked when the loop first reaches the state.

A step taken during backward used the state as it was then; the plain ``step()`` would
start from what the loop left there: a moment scaled in place
(``opt.state[p]["exp_avg"].mul_(0.5)``), a value replaced, the entry cleared
(``opt.state[p].clear()``), replaced or deleted, the state reset. That step cannot be
taken again, so such a write is refused at that ``step()``
(:func:`~overlapkit.overlap.core.late_changes.refuse_changed_gradients`), as a parameter
changed in place is. Reading the state is not a write (``opt.state[p]`` of a parameter
without state creates an empty entry: only entries that held state are compared).

After a stepping backward :class:`StateWrites` puts the optimizer's ``state`` behind a
:class:`~overlapkit.overlap.core.watched_reads.WatchedState` (the same dict) until
``step()`` or the next backward: the entries are marked the first time the loop
reaches the state through it, before anything it does there, and compared at
``step()`` only then. A loop that does not touch the state pays two attribute writes
per step; marking and comparing cost about 0.3 ms for 200 parameters of Adam on the
2-core test machine, which an eager mark at every backward would add to every step.
Not seen: a write through a reference to the state (or to a state tensor) taken
before that backward.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from overlapkit.overlap.core.watched_reads import WatchedState, loop_stacklevel

__all__ = ["StateMarks", "StateReadInWindowWarning", "StateWrites", "mark_entries",
           "state_read_warning", "written_entries"]


@attrs.frozen(eq=False)
class StateMarks:
    """The optimizer's state entries that hold state, in the state's order."""

    #: the parameters (the state's keys)
    params: list[Any]
    #: ``id`` of each entry and its length
    entries: list[int]
    lengths: list[int]
    #: ``id`` and version counter (None: not a tensor) of every entry's values, in order
    values: list[int]
    versions: list[int | None]

    def same(self, other: StateMarks) -> bool:
        """Nothing was written between the two marks (lists of integers compared)."""
        return (self.entries == other.entries and self.values == other.values
                and self.versions == other.versions and self.lengths == other.lengths)

    def by_param(self) -> dict[int, tuple[int, tuple[int, ...], tuple[int | None, ...]]]:
        """``id(param)`` -> its entry's ``id``, its values' ``id`` and versions."""
        found, start = {}, 0
        for param, entry, length in zip(self.params, self.entries, self.lengths, strict=True):
            end = start + length
            found[id(param)] = (entry, tuple(self.values[start:end]),
                                tuple(self.versions[start:end]))
            start = end
        return found


def _versions(values: list[Any]) -> list[int | None]:
    try:
        return [value._version for value in values]
    except AttributeError:  # a value that is not a tensor (a float step, None)
        return [getattr(value, "_version", None) for value in values]


def mark_entries(state: Mapping[Any, Any]) -> StateMarks:
    """The marks of the entries of ``state`` that hold state, as they are now."""
    held = [(param, entry) for param, entry in state.items() if entry]
    entries = [entry for _, entry in held]
    values = [value for entry in entries for value in entry.values()]
    return StateMarks([param for param, _ in held], list(map(id, entries)),
                      list(map(len, entries)), list(map(id, values)), _versions(values))


def written_entries(state: Mapping[Any, Any], marks: StateMarks,
                    names: Mapping[int, str]) -> list[str]:
    """The names of the parameters whose state entry was written, cleared, replaced or
    deleted since :func:`mark_entries` gave ``marks`` (state given to a parameter that
    had none is not looked at)."""
    now = mark_entries(state)
    if now.same(marks):
        return []
    before, after = marks.by_param(), now.by_param()
    found = []
    for param in marks.params:
        entry = after.get(id(param))
        if entry != before[id(param)]:
            name = names.get(id(param), f"a parameter of shape {tuple(param.shape)}")
            found.append(name if entry is not None else f"{name} (its entry emptied)")
    return found


class StateReadInWindowWarning(UserWarning):
    """The loop read the optimizer's state between a stepping backward and ``step()``:
    it holds this step's update already, the plain loop's the last step's."""


#: the optimizers whose loop was warned (once each)
_WARNED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def state_read_warning(technique: str) -> str:
    return (
        f"{technique} took this step during backward, so the optimizer's state read "
        "between backward() and optimizer.step() holds this step's update already (the "
        "plain loop's holds the last step's). Read the state after optimizer.step() or "
        "before backward(), or call optimizer.learn_first_step(model) once before the "
        "loop (a loop reading it at its first step then takes every step at "
        "optimizer.step(), bitwise the plain loop). A write there is refused at "
        "optimizer.step(). Shown once.")


class StateWrites:
    """The optimizer's ``state`` from a stepping backward to ``step()``: watched, its
    entries marked at the loop's first access (see the module docstring), which is
    warned of once per optimizer (:class:`StateReadInWindowWarning`) in a loop known to
    call ``step()`` (``technique`` given)."""

    def __init__(self, optimizer: torch.optim.Optimizer, technique: str | None = None) -> None:
        self.optimizer = optimizer
        self.technique = technique
        state = optimizer.state
        #: the dict behind, its id and length as the backward left it
        self.state: Any = state.state if isinstance(state, WatchedState) else state
        self.seen = (id(self.state), len(self.state))
        #: the entries when the loop first reached the state, or None
        self.marks: StateMarks | None = None
        self.watched: WatchedState | None = None
        if isinstance(state, WatchedState):  # watched already: mark now
            self.marks = mark_entries(self.state)
        else:
            self.watched = WatchedState(self.state, self)
            optimizer.state = self.watched  # type: ignore[assignment]

    @property
    def state_read(self) -> bool:
        """The loop has reached the state (:class:`WatchedState` sets it, first)."""
        return self.marks is not None

    @state_read.setter
    def state_read(self, value: bool) -> None:
        if value and self.marks is None:
            self.marks = mark_entries(self.state)
            if self.technique is not None and self.optimizer not in _WARNED:
                _WARNED.add(self.optimizer)
                warnings.warn(state_read_warning(self.technique), StateReadInWindowWarning,
                              stacklevel=loop_stacklevel())

    def note_read(self, name: str) -> None:
        """A gradient read: not this watch's."""

    def release(self) -> None:
        """Put the plain dict back (at ``step()``, at the next backward)."""
        if self.watched is not None and self.optimizer.state is self.watched:
            self.optimizer.state = self.state

    def reset(self) -> list[str]:
        """``["optimizer.state (N entries -> M, a reset)"]`` when the state was
        replaced or emptied, else empty (entries added by reads are not a reset)."""
        state = self.optimizer.state
        now = state.state if isinstance(state, WatchedState) else state
        if id(now) == self.seen[0] and (len(now) or not self.seen[1]):
            return []
        return [f"optimizer.state ({self.seen[1]} entries -> {len(now)}, a reset)"]

    def written(self, names: Mapping[int, str]) -> list[str]:
        """The names of the parameters whose entry the loop wrote (the state itself
        not reset)."""
        if self.marks is None or self.reset():
            return []
        return written_entries(self.state, self.marks, names)
