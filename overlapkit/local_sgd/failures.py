"""An averager that raises on one rank: the others told at once, through the store.

Averaging is a collective. When an averager raises on one rank — a bug of a plugin's,
a ``ConfigurationError`` for that rank's parameters — and the user's loop catches it and
goes on, the other ranks wait in its collective until the process group's timeout
(30 min by default) and then fail with gloo's ``Timed out waiting ... for recv``, which
names no rank and no averager; the failing rank's next collective may even pair with
theirs and abort the process (gloo: "Received data size doesn't match expected size").
Measured at f2b92e2, 2 gloo ranks, rank 1's averager raising at its first averaging and
the loop catching it: both processes killed (rank 0 by SIGABRT at rank 1's next
averaging) or, with no later collective, rank 0 waiting until the timeout.

Here (:func:`averaging_failures`, around :meth:`PostLocalSGDOptimizer.step
<overlapkit.PostLocalSGDOptimizer.step>`'s averaging) the failing rank leaves a note in
the default group's store, naming itself, the averager and its error, before the error
reaches the loop. Every collective overlapkit's averaging waits for
(:func:`wait_watching`: the agreement on which parameters have a gradient, the
averaging all-reduce, Streaming DiLoCo's) checks that note while it waits, and raises
:class:`~overlapkit.errors.ExchangeFailedError` naming the averager and the failing
rank within :data:`POLL_SECONDS`; so does an averager's own blocking collective
(``dist.all_reduce`` called by a plugin's averager,
:mod:`overlapkit.local_sgd.watched_collectives`). A collective that is still not
watched (one a plugin waits for itself) that fails at the timeout is named the same way.

After that the process group cannot be used (a collective is left half done), so the
next ``step()`` on every rank involved refuses before its local step and averaging — unless
every rank raised alike (the same error everywhere, no rank waiting), which leaves the
group in step: the run then goes on.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from overlapkit.errors import (
    CheckpointError,
    ConfigurationError,
    ExchangeFailedError,
    OverlapkitError,
    RanksLostError,
)
from overlapkit.local_sgd.watched_collectives import begin, end
from overlapkit.nodes.lost_ranks import is_peer_failure, name_lost_ranks, watch

__all__ = ["POLL_SECONDS", "averaging_failures", "load_averager_state", "refuse_after_failure",
           "restore_averager_state", "saved_averager_state", "wait_watching"]

#: how often a rank waiting in an averaging collective looks for a failure note
POLL_SECONDS = 0.2

#: how long a rank whose averager raised waits, at its next step(), for every rank's
#: note (all raised alike: the group is in step and the run goes on)
ALIKE_SECONDS = 2.0

_PREFIX = "overlapkit/averaging_failed/"
_WHAT = "averaging parameters (post-local SGD)"


class _State:
    """This process's view, per default process group."""

    def __init__(self) -> None:
        self.group_id: int | None = None
        self.store: Any = None
        #: failures every rank raised alike, recovered from: the note's generation
        self.generation = 0
        #: why this rank's next step() refuses: None while the group is in step
        self.broken: str | None = None
        #: this rank's own averager raised (not a waiter): look for the others' notes
        self.raised = False


_STATE = _State()
_LOCK = threading.Lock()


def _active() -> _State | None:
    """The state for the current default group (reset for a new one), or None without
    torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.distributed_c10d._get_default_group()
    with _LOCK:
        if _STATE.group_id != id(group):
            _STATE.__init__()  # type: ignore[misc]
            _STATE.group_id = id(group)
        if _STATE.store is None:
            # a connection of its own with a short timeout: the group's keeps its own
            store: Any = dist.distributed_c10d._get_default_store()
            try:
                store = store.clone()
                store.set_timeout(datetime.timedelta(seconds=5))
            except Exception:  # a store that cannot be cloned (not a TCPStore): shared
                pass
            _STATE.store = dist.PrefixStore(_PREFIX, store)
    return _STATE


def _note(state: _State) -> str | None:
    """The failure note of the current generation, if a rank left one."""
    key = str(state.generation)
    try:
        if not state.store.check([key]):
            return None
        return bytes(state.store.get(key)).decode(errors="replace")
    except Exception:  # the store is gone: the roll call of lost_ranks tells
        return None


def _failed_message(note: str, rank: int) -> str:
    return (f"{_WHAT} failed on rank {rank}: {note}, and the loop went on, so this "
            "rank was left waiting in the averaging collective (it would have waited "
            "until the process group's timeout). The process group cannot be used "
            "after this (a collective is half done). Fix that averager's error (its "
            "traceback is in that rank's output) and restart the job from the last "
            "checkpoint.")


def wait_watching(work: Any) -> None:
    """Wait for ``work`` (a collective started with ``async_op=True``); every
    :data:`POLL_SECONDS` of waiting, look for a failure note, and raise
    :class:`~overlapkit.errors.ExchangeFailedError` if a rank's averager raised.
    Without torch.distributed, a plain ``work.wait()``."""
    work = getattr(work, "work", work)  # a WatchedWork: the collective's own
    state = _active()
    if state is None:
        work.wait()
        return
    done = threading.Event()
    work.get_future().add_done_callback(lambda _: done.set())
    while not done.wait(POLL_SECONDS):
        note = _note(state)
        if note is not None:
            state.broken = note
            raise ExchangeFailedError(_failed_message(note, dist.get_rank()),
                                      what=_WHAT, silent=_failing_ranks(note))
    work.wait()  # raises the collective's own error, if it failed


def _failing_ranks(note: str) -> list[int]:
    match = re.match(r"rank (\d+)", note)
    return [int(match.group(1))] if match else []


@contextmanager
def averaging_failures(averager: Any) -> Iterator[None]:
    """Run an averaging (the body): an error of this rank's own is noted in the store
    for the others before it reaches the loop; a failed collective whose cause is
    another rank's note becomes the error naming it (else, as
    :func:`~overlapkit.nodes.lost_ranks.lost_ranks_named`, the lost ranks')."""
    step = getattr(averager, "step", "?")
    watch()  # this rank takes part in the roll call (lost ranks named)
    watching = begin()  # a plugin's own blocking collectives watched too
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as error:
        state = _active()  # only now: nothing on the steps that succeed
        if state is None:
            raise
        if isinstance(error, OverlapkitError) and state.broken is not None:
            raise  # a waiter's: named already
        if is_peer_failure(error) or isinstance(error, (RanksLostError, ExchangeFailedError)):
            note = _note(state)
            if note is None:
                named = name_lost_ranks(error, _WHAT)  # as lost_ranks_named
                if named is None:
                    raise
                raise named from error
            state.broken = note
            raise ExchangeFailedError(_failed_message(note, dist.get_rank()), what=_WHAT,
                                      silent=_failing_ranks(note)) from error
        rank = dist.get_rank()
        note = (f"rank {rank}'s averager {type(averager).__name__} raised "
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                f" at step {step}")
        try:
            state.store.set(str(state.generation), note)
            state.store.set(f"{state.generation}/rank{rank}", "1")
        except Exception:  # the store is gone: the others' roll call tells
            pass
        state.broken, state.raised = note, True
        add_note = getattr(error, "add_note", None)  # Python 3.11+
        if add_note is not None:
            add_note(f"overlapkit: {note}; the other ranks of its process group were told "
                     "(they raise ExchangeFailedError instead of waiting in its "
                     "collective). The next step() refuses unless every rank raised "
                     "alike: restart the job.")
        raise
    finally:
        end(watching)


def refuse_after_failure() -> None:
    """At ``step()``, before anything changes: refuse when an averaging failed on some
    rank and the process group is out of step; go on when every rank raised alike."""
    state = _STATE
    if state.broken is None or _active() is not state:
        return
    if state.raised and _all_raised(state):
        state.broken = None
        state.generation += 1
        return
    raise ExchangeFailedError(
        f"PostLocalSGDOptimizer.step() refused: an earlier averaging failed ({state.broken})"
        " and the loop went on, but the process group is out of step since (a collective "
        "was left half done on some rank), so the next one would hang or pair with the "
        "wrong one. This step() took no local step and averaged nothing (an overlapped "
        "local optimizer steps during backward, before it). Fix that averager's error "
        "and restart the job from the last checkpoint.", what=_WHAT,
        silent=_failing_ranks(state.broken))


def _all_raised(state: _State) -> bool:
    """Whether every rank noted an error of its own in this generation (looking for
    their notes for up to :data:`ALIKE_SECONDS`); asked once per failure."""
    state.raised = False  # out of step unless all did: not asked again
    keys = [f"{state.generation}/rank{r}" for r in range(dist.get_world_size())]
    deadline = time.monotonic() + ALIKE_SECONDS
    while True:
        try:
            if state.store.check(keys):
                return True
        except Exception:  # the store is gone
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_SECONDS / 2)


def saved_averager_state(averager: Any) -> Mapping[str, Any]:
    """``averager.state_dict()``, refused unless it is a dict: a checkpoint holding
    anything else saves fine and fails at resume, hours later (f2b92e2: a plugin
    averager whose ``state_dict`` returned None was refused only by
    ``load_state_dict``)."""
    state = averager.state_dict()
    if not isinstance(state, Mapping):
        raise ConfigurationError(
            f"{type(averager).__name__}.state_dict() returned a {type(state).__name__}, "
            "not a dict, so a checkpoint holding it could not be resumed from; the "
            "averager (or its plugin) must return a dict with at least 'step' "
            "(ModelAverager.state_dict() does: extend super().state_dict()).")
    return state


def load_averager_state(averager: Any, state: Mapping[str, Any]) -> None:
    """``averager.load_state_dict(state)``; an error of the averager's own becomes a
    :class:`~overlapkit.errors.CheckpointError` naming it (f2b92e2: a plugin's bare
    ``KeyError``, raised again by the roll-back that hid the first)."""
    try:
        averager.load_state_dict(state)
    except OverlapkitError:
        raise
    except Exception as error:
        raise CheckpointError(
            f"{type(averager).__name__}.load_state_dict() refused the saved averager "
            f"state (keys {sorted(map(str, state))}): {type(error).__name__}: {error}. "
            "Load the state_dict() of a PostLocalSGDOptimizer with the same averager "
            "(and averager options). Nothing was loaded.") from error


def restore_averager_state(averager: Any, state: Mapping[str, Any]) -> None:
    """Put ``averager`` back to ``state`` after a refused load; an averager whose
    ``load_state_dict`` fails on that too keeps what it has (the refusal is raised)."""
    with contextlib.suppress(Exception):
        averager.load_state_dict(state)
