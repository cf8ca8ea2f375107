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
  changes bump a tensor's version; ``param.grad = ...`` replaces it; a write through
  ``.data``, which bumps none, is noted by :mod:`~overlapkit.overlap.core.data_writes`):
  a gradient changed before ``step()`` shows the loop edits gradients;
- a ``clip_grad_norm_`` / ``clip_grad_value_`` the loop ran on the kept gradients (the
  plain loop's own clip, bumping their versions; not an edit, and the full step then
  does not clip again);
- the optimizer's param-group settings (``lr``, ``weight_decay``, ...) at the end of
  each backward: one changed before ``step()`` (a warm-up written by hand, a scheduler
  stepped before the optimizer) is taken by the plain step, and would miss a step
  taken during backward;
- each parameter's version counter (a clamp before ``step()``: the plain step's start);
- a read of ``optimizer.state`` (Adam's moments logged): from the second step on it
  would hold that step's update already (reads noticed by
  :mod:`~overlapkit.overlap.core.watched_reads`, as a kept gradient's are).

At ``step()`` the first step is taken as the plain loop takes it (a full step of the
kept gradients). A loop that used the window keeps every later step in that plain
order, with one warning naming what it did and how to keep the overlap: the run is
the plain run, bitwise. Any other loop steps during backward from its second step on.

In a loop no integration sets up, the step is taken during backward from the first,
so what the loop does in the window that the plain ``step()`` would have used is
refused at that ``step()``
(:mod:`~overlapkit.overlap.core.late_changes`), from the first step on:
a gradient changed or set, a parameter changed in place, a param-group setting changed
(a warm-up, ``lr_scheduler.step()`` called first), a param group added, the state reset
or one parameter's entry written (:mod:`~overlapkit.overlap.core.state_marks`).
The parameters have taken the step by then: the message says so, and names
``learn_first_step`` (:data:`LEARN`), which has such a loop learnt as above.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from overlapkit.overlap.core.data_writes import DataWrites, plain_state
from overlapkit.overlap.core.group_settings import changed_settings, settings
from overlapkit.overlap.core.state_marks import StateWrites
from overlapkit.overlap.core.watched_params import (
    ParameterReads,
    unwatch_params,
    watch_params,
    watched_class,
)
from overlapkit.overlap.core.watched_reads import (
    WatchedState,
    is_watched,
    quiet_reads,
    unwatch_grad,
    watch_grad,
)

__all__ = ["LEARN", "NO_GRAD", "FirstWindow", "clear_stepped", "quiet_reads", "shown_names",
           "state"]

#: what a hand-written loop that works in the window calls to have it honoured
LEARN = ("optimizer.learn_first_step(model) (the first step is then taken at "
         "optimizer.step() and shows the loop uses this window: every step stays there, "
         "in the plain order, bitwise the plain loop, with one warning)")


#: :func:`state` of a parameter without a gradient
NO_GRAD = (0, 0)


def state(param: torch.Tensor) -> tuple[int, int]:
    """What tells that ``param``'s gradient changed: its identity and version counter."""
    grad = param.grad
    return NO_GRAD if grad is None else (id(grad), grad._version)


def shown_names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (" and others" if len(names) > 3 else "")


def clear_stepped(marks: FirstWindow | None, engine: Any) -> None:
    """Clear the gradients of ``engine``'s parameters (``zero_grad()``) as a forward
    follows a stepping backward of a loop not known to call ``step()`` yet (a
    backward-only loop's next iteration): not an edit of the loop's in ``marks`` (those
    the backward left), unless the loop had changed that gradient before."""
    params, written = engine.parameters(), set() if marks is None else marks.written()
    unedited = [] if marks is None else [
        p for p in params if marks.marks.get(id(p)) == state(p) and id(p.grad) not in written]
    engine.zero_grad(set_to_none=True)
    if marks is not None:
        for param in unedited:
            marks.marks[id(param)] = state(param)


@attrs.define
class FirstWindow:
    """What the loop did between backward and ``step()`` while steps are deferred to learn
    it (see the module docstring)."""

    #: backwards that would have stepped (not inside ``no_sync()`` / ``no_step()``)
    backwards: int = 0
    #: ``id(param)`` -> ``(id(grad), grad._version)`` at the end of the last backward,
    #: and -> ``param._version``
    marks: dict[int, tuple[int, int]] = attrs.field(factory=dict)
    versions: dict[int, int] = attrs.field(factory=dict)
    #: the loop clipped the kept gradients itself (torch's clip, in place)
    clipped: bool = False
    #: the loop has been found to use the window: every step stays in the plain order
    plain_order: bool = False
    #: ``id(param)`` -> name, when the loop reading a gradient uses the window too (the
    #: technique frees it, or clips it during backward): the kept gradients are then
    #: watched (:mod:`~overlapkit.overlap.core.watched_reads`) until ``step()``; None:
    #: reads are not watched
    watching: dict[int, str] | None = None
    #: the names of the gradients the loop read
    read: list[str] = attrs.field(factory=list)
    #: the real optimizer whose param-group settings are compared, or None
    optimizer: torch.optim.Optimizer | None = None
    #: its :func:`settings` at the end of the last backward
    settings: list[dict[str, Any]] | None = None
    #: the loop read (or wrote) ``optimizer.state`` between a backward and ``step()``
    state_read: bool = False
    #: ``zero_grad()`` discarded the gradients of a backward without a ``step()``
    discarded: bool = False
    #: the loop's own clip by a finite norm has run on the kept gradients
    clipped_to_norm: bool = False
    #: the loop clipped (or asked their norm) again after that: it reads the clipped
    #: gradients' norm, which a step taken during backward does not keep
    clipped_again: bool = False
    #: how many backwards the window had at the loop's last clip by norm, and whether a
    #: clip came again after a later backward of the same step (a clip per micro-batch:
    #: the plain loop clips the partial sums, and each returns their norm)
    clipped_at_backward: int = -1
    clipped_per_backward: bool = False
    #: the ``clip_grad_norm=`` the loop says it clips with before each ``step()``
    #: (Accelerate's ``prepare``), or None: a first step without that clip is refused
    loop_clips: float | None = None
    #: the loop's clip by the set-up norm left out this many of the optimizer's
    #: parameters with gradients (a clip of part of the model), or 0
    clipped_part: int = 0
    #: the loop's first step was learnt (``learn_first_step``): its refusals do not
    #: suggest it
    learned: bool = False
    #: the optimizer's ``state`` watched after a stepping backward (:meth:`mark_state`)
    state_writes: StateWrites | None = None
    #: the parameters watched after a stepping backward (:meth:`mark_state`)
    param_reads: ParameterReads | None = None
    #: ``id(param)`` of the parameters whose values the loop read since the last
    #: backward (:mod:`~overlapkit.overlap.core.watched_params`), in order
    params_read: list[int] = attrs.field(factory=list)
    #: the parameters watched for those reads, and their watched class
    params_watched: list[torch.Tensor] = attrs.field(factory=list)
    params_class: type | None = None
    #: what a ``torch.amp.GradScaler`` drove around the optimizer (a wrapper: its
    #: unscale writes the gradients bumping no version counter), or None
    #: (:mod:`~overlapkit.overlap.scaler_guard`)
    scaler: str | None = None
    #: the loop's writes through ``.data`` since the end of the last backward
    #: (:mod:`~overlapkit.overlap.core.data_writes`), or None
    data_writes: DataWrites | None = None

    def open_data_writes(self, params: list[torch.Tensor]) -> None:
        """Note writes through the ``.data`` of ``params`` and of their gradients from
        now (the end of a backward) until
        :meth:`close_data_writes`: seen by :meth:`edited` and :meth:`moved` as the
        version counters are (which such a write does not bump)."""
        self.close_data_writes()
        self.data_writes = DataWrites(params, self.optimizer)

    def close_data_writes(self) -> None:
        """Stop noting writes through ``.data``; those noted stay for :meth:`edited`
        and :meth:`moved`."""
        if self.data_writes is not None:
            self.data_writes.close()

    def written(self) -> set[int]:
        """``id`` of the tensors the loop wrote through ``.data`` (none: no cost)."""
        return set() if self.data_writes is None else self.data_writes.changed()

    def mark(self, params: Iterable[torch.Tensor]) -> None:
        """Record the gradients of ``params`` as they are now (end of a backward, or
        right after the loop's own clip); watch their reads where asked."""
        # runs once per parameter at the end of every stepping backward: locals only
        marks, versions, watching = self.marks, self.versions, self.watching
        for param in params:
            key = id(param)
            grad = param.grad
            if grad is None:
                marks[key] = NO_GRAD
            else:
                if watching is not None and not is_watched(grad):
                    watch_grad(param, self, watching.get(
                        key, f"a parameter of shape {tuple(param.shape)}"))
                    grad = param.grad
                marks[key] = NO_GRAD if grad is None else (id(grad), grad._version)
            versions[key] = param._version

    def mark_settings(self) -> None:
        """Record the optimizer's param-group settings as a backward leaves them (those
        a step taken in it used)."""
        if self.optimizer is not None:
            self.settings = settings(self.optimizer)

    def mark_state(self, warn_reads: str | None = None) -> None:
        """Watch the optimizer's ``state`` as a stepping backward leaves it, until
        :meth:`release_state`: a reset or replaced state before ``step()`` shows, and a
        write to one parameter's entry (:mod:`~overlapkit.overlap.core.state_marks`);
        ``warn_reads``: the technique, to warn of a read (a loop known to call
        ``step()``)."""
        if self.optimizer is not None:  # once per marks: the last ones released first
            self.state_writes = StateWrites(self.optimizer, warn_reads)

    def watch_reads(self, params: list[torch.Tensor], technique: str,
                    owner: Any, freed: bool = False, first: bool = False) -> None:
        """Warn of the loop's first read of the values of ``params`` (stepped by the
        backward that ended: :class:`ParameterReads`) until :meth:`release_state`, and
        (``freed``: it freed their gradients) of its reads of their ``.grad``; ``first``:
        the loop is not known to call ``step()`` yet, warned only by a ``step()``."""
        self.param_reads = ParameterReads(params, technique, owner, freed, first=first)

    def release_state(self, at_step: bool = False) -> None:
        """Stop watching the state and the parameters (``step()``: ``at_step``, the next
        backward); what was noted stays for :meth:`state_reset` and
        :meth:`state_written`."""
        if self.state_writes is not None:
            self.state_writes.release()
        if self.param_reads is not None:
            self.param_reads.release(at_step)
        self.close_data_writes()

    def state_written(self, names: Mapping[int, str]) -> list[str]:
        """The names of the parameters whose state entry the loop wrote since
        :meth:`mark_state` (the state itself not reset)."""
        found = [] if self.state_writes is None else self.state_writes.written(names)
        written = self.written()  # through .data (no version bumped)
        if written and self.optimizer is not None:
            found.extend(
                names.get(id(param), f"a parameter of shape {tuple(param.shape)}")
                for param, entry in plain_state(self.optimizer).items()
                if any(id(value) in written for value in entry.values())
                and names.get(id(param)) not in found)
        return found

    def state_reset(self) -> list[str]:
        """``["optimizer.state (N entries -> M, a reset)"]`` when it was replaced or
        emptied since :meth:`mark_state`, else empty."""
        return [] if self.state_writes is None else self.state_writes.reset()

    def watch_state(self) -> None:
        """Note the loop's reads of ``optimizer.state`` until :meth:`unwatch` (while
        the first window is learnt)."""
        optimizer = self.optimizer
        if (optimizer is not None and not self.plain_order
                and not isinstance(optimizer.state, WatchedState)):
            optimizer.state = WatchedState(optimizer.state, self)  # type: ignore[assignment]

    def changed_settings(self) -> list[str]:
        """The settings changed since :meth:`mark_settings` (:func:`changed_settings`)."""
        if self.optimizer is None or self.settings is None:
            return []
        found, written = changed_settings(self.settings, self.optimizer), self.written()
        found.extend(f"{key} of param group {index}"
                     for index, group in enumerate(self.optimizer.param_groups)
                     for key, value in group.items() if id(value) in written
                     and f"{key} of param group {index}" not in found)
        return found

    def note_clip(self, by_norm: bool, finite: bool) -> None:
        """Once per call of the loop's clip on gradients this window keeps: whether it
        clips (or asks the norm) again after a clip by a finite norm, and whether a
        backward came between the two (twelfth probe: Accelerate clipping every
        micro-batch was warned of as a second clip after the loop's)."""
        if by_norm and self.clipped_to_norm:
            self.clipped_again = True
            self.clipped_per_backward = (self.clipped_per_backward
                                         or self.backwards > self.clipped_at_backward)
        if by_norm:
            self.clipped_at_backward = self.backwards
        self.clipped_to_norm = self.clipped_to_norm or finite

    def discard(self) -> None:
        """``zero_grad()`` was called: the backwards so far are not this step's."""
        self.discarded = self.discarded or self.backwards > 0
        self.backwards, self.marks = 0, {}
        self.close_data_writes()
        self.data_writes = None

    def note_read(self, name: str) -> None:
        if name not in self.read:
            self.read.append(name)

    def watch_params(self, params: Iterable[torch.Tensor]) -> None:
        """Note the loop's reads of the values of ``params`` (the backward that ended
        would have stepped them) until :meth:`unwatch` or :meth:`backward_starts`."""
        if not self.plain_order:
            if self.params_class is None:
                self.params_class = watched_class()
            self.params_watched = list(params)
            watch_params(self.params_watched, self.params_class, self)

    def note_param_read(self, param: torch.Tensor) -> None:
        if id(param) not in self.params_read:
            self.params_read.append(id(param))

    def backward_starts(self) -> None:
        """A backward of this step starts: what the loop read since the last one (that
        micro-batch's forward) saw the same values as the plain loop's."""
        self.unwatch_params()
        self.params_read = []
        self.close_data_writes()

    def unwatch_params(self) -> None:
        if self.params_class is not None:
            unwatch_params(self.params_watched, self.params_class)
        self.params_watched = []

    def unwatch(self, params: Iterable[torch.Tensor]) -> None:
        """Put the plain gradients and state back (before the step reads them); stop
        watching."""
        self.watching = None
        self.unwatch_params()
        self.close_data_writes()
        state = None if self.optimizer is None else self.optimizer.state
        if isinstance(state, WatchedState):
            self.optimizer.state = state.state
        for param in params:
            unwatch_grad(param)

    def clipped_by_loop(self, param: torch.Tensor, before: tuple[int, int]) -> None:
        """The loop's clip rewrote ``param``'s gradient (in place), which was ``before``
        (:func:`state`) then: not an edit, unless it had been edited before the clip."""
        if self.marks.get(id(param)) == before:
            self.mark([param])

    def edited(self, named: Mapping[int, str], params: Iterable[torch.Tensor]) -> list[str]:
        """The names of ``params`` whose gradient changed since it was marked."""
        marks, written = self.marks, self.written()
        found = []
        for param in params:  # once per parameter at every step(): locals only
            mark = marks.get(id(param))
            if mark is None:
                continue
            grad = param.grad
            if grad is None:
                if mark[0]:  # it had one (a gradient's id is never 0)
                    found.append(param)
            elif mark[0] != id(grad) or mark[1] != grad._version or id(grad) in written:
                found.append(param)
        return [named.get(id(p), f"a parameter of shape {tuple(p.shape)}") for p in found]

    def moved(self, named: Mapping[int, str], params: Iterable[torch.Tensor]) -> list[str]:
        """The names of ``params`` changed in place since marked."""
        versions, written = self.versions, self.written()
        return [named.get(id(p), f"a parameter of shape {tuple(p.shape)}") for p in params
                if versions.get(id(p), -1) not in (-1, p._version) or id(p) in written]

    def reset(self) -> None:
        """A new optimizer step starts (after ``step()``)."""
        self.backwards, self.marks, self.clipped, self.settings = 0, {}, False, None
        self.versions = {}
        self.close_data_writes()
        self.data_writes = None
        self.clipped_to_norm = False
        self.clipped_at_backward = -1
