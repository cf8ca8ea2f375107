"""The roll call: which ranks are still there, asked through the process group's store.

Used by :mod:`overlapkit.nodes.lost_ranks` once a collective failed because of a peer.
Every rank overlapkit sets a collective up on is *watched* (:func:`watch`): it records
its node in the store, beats a heartbeat there (a daemon thread, one small ``add``
every :data:`HEARTBEAT_SECONDS`), and leaves a note at exit. A rank that caught the
failure answers the roll call (:func:`roll_call`, once per process) and waits up to
:data:`ROLL_CALL_SECONDS` for every other rank to answer, to beat, or to have left a
note; the rest are lost.

The heartbeat is what keeps a survivor that is still blocked in a collective with a
live peer from being named: it fails only once that peer's process ends, or after the
process group's timeout (measured: in a ring allreduce with two of four ranks killed,
one survivor fails at once and the other keeps waiting on it).

The store is the default group's (under torchrun the agent of node 0 keeps it; with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, and outside torchrun, rank 0's process),
reached through a connection of its own with short timeouts, so a store whose host is
gone or hangs is reported as such instead of blocking for the group's whole timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from overlapkit.nodes.layout import this_node

__all__ = ["HEARTBEAT_SECONDS", "ROLL_CALL_SECONDS", "Verdict", "agent_keeps_store",
           "first_line", "roll_call", "watch"]

#: how long survivors wait for every rank to answer (or to have left a note at exit)
#: before naming the silent ones lost; long enough for a survivor busy elsewhere to
#: reach its own failure, short against any process-group timeout
ROLL_CALL_SECONDS = 5.0

#: how often each watched rank beats its heartbeat in the store
HEARTBEAT_SECONDS = 1.0

#: how long one store operation of the roll call may take (a store whose host hangs)
_STORE_SECONDS = 5.0

#: a rank that keeps the store waits this long at most for the others to finish
#: their roll call before it raises (and its process, with the store, ends)
_HOST_WAITS_SECONDS = 3.0

_PREFIX = "overlapkit/roll_call/"

T = TypeVar("T")


def _bounded(call: Callable[[], T], seconds: float) -> T:
    """``call()``, or ``TimeoutError`` if it has not returned within ``seconds`` (a
    store whose host hangs blocks a connection attempt for the group's whole timeout)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as error:  # handed to the caller
            outcome.append((False, error))

    thread = threading.Thread(target=run, daemon=True, name="overlapkit-roll-call")
    thread.start()
    thread.join(seconds)
    if not outcome:
        raise TimeoutError(f"no answer within {seconds:.0f} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _store(seconds: float) -> Any:
    """A connection of its own to the default group's store, with a short timeout, under
    overlapkit's prefix (a clone: the process group's own connection keeps its timeout)."""
    import torch.distributed as dist

    # the default group's store: torch has no public accessor (stable since torch 1.8)
    store = dist.distributed_c10d._get_default_store().clone()  # type: ignore[attr-defined]
    store.set_timeout(datetime.timedelta(seconds=seconds))
    return dist.PrefixStore(_PREFIX, store)


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


#: id of a watched default group -> its heartbeat (``None``: the store did not answer);
#: a group whose heartbeat ended (destroyed: its id may be another group's now) is
#: watched again
_WATCHED: dict[int, threading.Thread | None] = {}
_WATCH_LOCK = threading.Lock()
_HEARTBEAT_STOP = threading.Event()
_HEARTBEATS: list[threading.Thread] = []


def watch() -> None:
    """Take part in the roll call: record this rank's node in the store (for the
    messages of the others), beat a heartbeat there (a daemon thread, one small ``add``
    every :data:`HEARTBEAT_SECONDS` while the process group lives), and leave a note
    there at exit (a rank that ends on an error of its own is then not named lost).

    Called by overlapkit when it sets up a collective (comm hooks, post-local SGD,
    checkpoint save and load); cheap after the first call, never raises, runs no
    collective."""
    if not _initialized():
        return
    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group()
    with _WATCH_LOCK:
        if id(group) in _WATCHED:
            known = _WATCHED[id(group)]
            if known is None or known.is_alive():
                return
        first = not _HEARTBEATS
        _WATCHED[id(group)] = None
        rank = dist.get_rank()
        try:
            store = _bounded(lambda: _store(_STORE_SECONDS), _STORE_SECONDS)
            store.set(f"node/{rank}", this_node()[1])
            store.add(f"beat/{rank}", 1)
        except Exception:  # the roll call then knows this rank by its answer alone
            return
        # a weak reference: the process group must go with destroy_process_group(),
        # on the thread calling it, not when this daemon thread next wakes (or at
        # interpreter exit, where a gloo group's destructor aborts the process)
        thread = threading.Thread(target=_beat, args=(store, rank, weakref.ref(group)),
                                  daemon=True, name="overlapkit-heartbeat")
        thread.start()
        _WATCHED[id(group)] = thread
        _HEARTBEATS.append(thread)
    if first:
        atexit.register(_leave_note)


def _beat(store: Any, rank: int, group: weakref.ref[Any]) -> None:
    """Beat until the process group is destroyed (or replaced), the store is gone, or
    the process exits."""
    import torch.distributed as dist

    while not _HEARTBEAT_STOP.wait(HEARTBEAT_SECONDS):
        try:
            if not _initialized() or dist.distributed_c10d._get_default_group() is not group():
                return
            store.add(f"beat/{rank}", 1)
        except Exception:  # the group was destroyed meanwhile, or the store is gone
            return


def _leave_note() -> None:
    """At exit: stop the heartbeat, and note in the store that this rank ended (not
    lost)."""
    _HEARTBEAT_STOP.set()
    for thread in _HEARTBEATS:  # not inside a store call when the interpreter ends
        thread.join(timeout=_STORE_SECONDS)
    if not _initialized():
        return
    import torch.distributed as dist

    rank = dist.get_rank()
    with contextlib.suppress(Exception):  # a store that is gone: nothing to tell it
        _bounded(lambda: _store(1.0).set(f"left/{rank}", "1"), 2.0)


class Verdict:
    """What a roll call found: who answered, beat or had left, the lost ranks' nodes,
    and whether the store answered at all."""

    def __init__(self, *, world: int, answered: set[int], beating: set[int],
                 left: set[int], nodes: dict[int, str], store_error: str | None,
                 seconds: float, cut_short: bool = False) -> None:
        self.world = world
        #: the store stopped answering during the roll call (the ranks not seen by
        #: then are named lost)
        self.cut_short = cut_short
        self.answered = answered
        self.beating = beating
        self.left = left
        self.nodes = nodes
        self.store_error = store_error
        self.seconds = seconds

    @property
    def lost(self) -> list[int]:
        if self.store_error is not None:
            return _store_keepers(self.world)
        return sorted(set(range(self.world)) - self.alive - self.left)

    @property
    def alive(self) -> set[int]:
        return self.answered | self.beating


#: the default group a roll call was taken for, and its verdict
_VERDICT: list[tuple[Any, Verdict]] = []
_ROLL_CALL_LOCK = threading.Lock()


def roll_call() -> Verdict:
    """Take the roll call (a few seconds), or return the one this process already took
    for the default group: a failure is final for a process group, so later ones (other
    buckets of the same backward, the next overlapkit call) share the first verdict."""
    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group()
    with _ROLL_CALL_LOCK:
        if not _VERDICT or _VERDICT[0][0] is not group:
            _VERDICT[:] = [(group, _take_roll_call())]
        return _VERDICT[0][1]


def agent_keeps_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _store_keepers(world: int) -> list[int]:
    """The ranks lost with the store: node 0's under torchrun's shared store (its agent
    keeps it), else rank 0 (whose process keeps it)."""
    if agent_keeps_store():
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        return list(range(min(per_node, world)))
    return [0]


def _take_roll_call() -> Verdict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.monotonic()
    answered: set[int] = {rank}
    beating: set[int] = set()
    left: set[int] = set()
    nodes: dict[int, str] = {}

    def verdict(store_error: str | None = None, cut_short: bool = False) -> Verdict:
        return Verdict(world=world, answered=answered, beating=beating, left=left,
                        nodes=nodes, store_error=store_error,
                        seconds=time.monotonic() - started, cut_short=cut_short)

    try:
        store = _bounded(lambda: _store(_STORE_SECONDS), _STORE_SECONDS)
        store.set(f"answer/{rank}", "1")
        beats = {other: int(store.add(f"beat/{other}", 0)) for other in range(world)}
    except Exception as error:
        return verdict(f"{type(error).__name__}: {first_line(error)}")
    deadline = started + ROLL_CALL_SECONDS
    try:
        while True:
            for other in range(world):
                if other in answered or other in left:
                    continue
                if store.check([f"answer/{other}"]):
                    answered.add(other)
                elif store.check([f"left/{other}"]):
                    left.add(other)
                elif other not in beating and int(store.add(f"beat/{other}", 0)) > beats[other]:
                    beating.add(other)
            if len(answered | beating | left) == world or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        for other in sorted(set(range(world)) - answered - beating - left):
            if store.check([f"node/{other}"]):
                nodes[other] = store.get(f"node/{other}").decode()
        store.set(f"done/{rank}", "1")
        if rank == 0 and not agent_keeps_store():
            # this process keeps the store: stay until the others have read it
            until = time.monotonic() + _HOST_WAITS_SECONDS
            while time.monotonic() < until and not all(
                    store.check([f"done/{other}"]) for other in answered):
                time.sleep(0.05)
    except Exception:  # the store went away half-way: judge by what was seen
        return verdict(cut_short=True)
    return verdict()


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line if len(line) <= 300 else line[:297] + "..."
