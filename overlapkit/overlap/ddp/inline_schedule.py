"""When a CPU rank steps its buckets at the end of backward: while the reductions still
in flight complete, or once they all have. Chosen by measuring.

On CPU the thread that steps is the thread that runs backward, so the bucket stepper
leaves every step to the end of backward's computation
(:class:`~overlapkit.overlap.ddp.bucket_stepper.BucketStepper`). What is left then is
a choice of order:

- ``"fill"``: step each run of buckets whose reduction has completed while the others
  are still in flight. This is the overlap: where the reductions wait for a network
  (or for a slower peer), the steps take the time the rank would otherwise spend
  waiting (measured on torch 2.13, 2 gloo ranks over a simulated 2 Gb/s link: saves
  0.8-0.9 of the plain ``step()``).
- ``"after"``: wait for every reduction, then step all the buckets in one call, as the
  plain loop's ``step()`` after backward does.

Which is faster depends on what the reductions wait for, and on their size (measured
on torch 2.13, 2 gloo ranks on a 2-core VM, waiting as :func:`block_on` waits, ms per
training step, ``benchmarks/inline_waits.py``, two runs):

- over a network (or for a slower peer) the wait is idle, and ``"fill"`` hides the
  steps in it (simulated 5, 2, 1 Gb/s links: 0.75-0.85 of the plain ``step()`` saved);
- where the reductions are themselves work for this machine's cores — ranks on one
  machine reducing over loopback, gloo's threads copying and summing — it depends on
  the buckets. A chain of small reductions is held up by steps taken beside it:
  100 buckets of 256 KiB "after" 81 ms, "fill" 88-91; 400 of 16 KiB 96-112 and
  108-117. Big buckets' reductions leave gaps the steps fill: 6 buckets of 4 MiB
  "fill" 47-48, "after" 48-51; 4 MB buckets over a simulated 10 Gb/s link (whose
  waits keep gloo's threads busy too) 82 and 87; 50 buckets of 1 MiB tie (103-106).

So the rank measures what its waits are. Whenever it waits for a reduction, it notes
the CPU time its communication threads spend meanwhile (gloo's, read per thread:
:mod:`~overlapkit.overlap.ddp.comm_threads`). Where, over its last :data:`TRIALS` ends
of backward, that kept less than :data:`BUSY` of a core busy, the wait is idle and the
order is ``"fill"`` (measured: 0.02-0.13 of a core over the simulated links, whose
transfers take no CPU time, as a network card's; 0.27-0.92 over loopback with small
buckets, where the order depends on it). Otherwise the order follows the size of the
buckets: ``"fill"`` where they hold :data:`FILL_FROM_BYTES` or more on average,
``"after"`` below.

Not timed turns of each order: an earlier version timed five ends of backward in each
order and kept the shorter median, and on every model above it picked the slower order
in a third to all of the rank-runs (the ends of backward vary with when the peer
arrives far more than the orders differ, and an end of backward in ``"fill"`` leaves
part of what it costs to the peer and to the next one): the measurements are in
``docs/benchmarks.md``. The bucket sizes are the same on every rank; the busy share is
each rank's own, so ranks whose share is near :data:`BUSY` may choose differently,
which changes timings only. Until measured, the order is ``"after"``. The busy share
is followed from then on: a network that gets busy or idle again changes the order. A
rank whose reductions are always complete by the end of backward (one rank, or a
network faster than backward) never waits and has nothing to choose: both orders are
then the same. The order changes only timings: both step the same parameters with the
same gradients.

.. versionadded:: 0.4
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import suppress
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.overlap.ddp.comm_threads import COMM_THREADS

__all__ = ["AFTER", "BUSY", "FILL", "FILL_FROM_BYTES", "SETTLED", "SPIN", "TRIALS",
           "InlineSchedule", "block_on", "mean_bucket_bytes", "spare_cores"]

FILL = "fill"
AFTER = "after"
#: the ends of backward whose waits say whether the reductions are CPU work
TRIALS = 3
#: the share of a core the communication threads keep busy while it waits, from
#: which its reductions count as CPU work (measured: 0.02-0.13 over simulated links
#: with big buckets, 0.19-0.21 with 100 buckets of 256 KiB at 1 Gb/s, whose real
#: loopback reductions gloo still runs; over loopback 0.27-0.92 with small buckets,
#: 0.19-0.8 with big ones, where either choice steps "fill")
BUSY = 0.25
#: where the reductions are CPU work: the mean bucket size (bytes) from which the
#: order is "fill" (measured: "after" faster at 16 and 256 KiB, a tie at 1 MiB,
#: "fill" faster at 4 MiB)
FILL_FROM_BYTES = 1 << 20
#: ends of backward not measured first (DDP rebuilds its buckets after the first
#: iteration; the first steps create the optimizer's state)
_SKIPPED = 2
#: ends of backward after which a rank has chosen its order (benchmarks warm up this
#: long: the choice is a start-up cost, as DDP's rebuild)
SETTLED = _SKIPPED + TRIALS
#: the longest a rank spins waiting for one reduction before it blocks (seconds)
SPIN = 0.05


class InlineSchedule:
    """The order of one CPU bucket stepper's steps at the end of backward."""

    def __init__(self, spare: bool | None = None) -> None:
        #: whether this rank's threads have a core each (:func:`spare_cores`, unless
        #: ``spare`` says): a spinning wait then takes no core another thread needs
        self.spare_cores = spare_cores() if spare is None else spare
        self._seen = 0
        #: (wall seconds, communication threads' CPU seconds) waiting, per end of backward
        self._waits: deque[tuple[float, float]] = deque(maxlen=TRIALS)
        #: the mean size of the buckets (bytes), once asked (:meth:`order`)
        self.bucket_bytes: float | None = None
        #: an order set by hand (a benchmark comparing the two): no measurement then
        self.fixed: str | None = None
        #: whether waits spin, set by hand (a benchmark comparing): None, as measured
        self.fixed_spin: bool | None = None

    @property
    def busy_waits(self) -> bool | None:
        """Whether the last waits kept :data:`BUSY` of a core busy (None: not known)."""
        if len(self._waits) < TRIALS:
            return None
        return self.busy >= BUSY

    @property
    def spins(self) -> bool:
        """Whether a wait for a reduction spins (:func:`block_on`): unless the waits
        are known to be idle, as over a network, where a blocked thread loses
        nothing."""
        if self.fixed_spin is not None:
            return self.fixed_spin
        return self.spare_cores and self.busy_waits is not False

    @property
    def chosen(self) -> str | None:
        """The order chosen by the measurements so far (None while they are taken)."""
        if self.fixed is not None:
            return self.fixed
        busy = self.busy_waits
        if busy is None:
            return None
        if not busy:
            return FILL
        if self.bucket_bytes is None:
            return None  # asked by the next order()
        return FILL if self.bucket_bytes >= FILL_FROM_BYTES else AFTER

    def order(self, bucket_bytes: Callable[[], float]) -> str:
        """The order for this end of backward, where reductions are still in flight;
        ``bucket_bytes()`` gives their buckets' mean size, asked once where it
        decides (DDP's buckets are fixed from its rebuild after the first
        iteration, before the waits are measured)."""
        if self.bucket_bytes is None and self.busy_waits and self.fixed is None:
            self.bucket_bytes = bucket_bytes()
        chosen = self.chosen
        return AFTER if chosen is None else chosen  # measured in the plain order

    def ended(self, blocked_s: float, cpu_s: float) -> None:
        """An end of backward with reductions in flight waited ``blocked_s`` for them
        in all, while the communication threads used ``cpu_s`` seconds of CPU."""
        if self.fixed is not None:
            return
        self._seen += 1
        if self._seen > _SKIPPED and blocked_s > 0:
            self._waits.append((blocked_s, cpu_s))

    @property
    def busy(self) -> float:
        """The share of a core the communication threads kept busy over the waits
        kept."""
        wall = sum(wall for wall, _ in self._waits)
        return sum(cpu for _, cpu in self._waits) / wall if wall > 0 else 0.0

    @property
    def waits(self) -> list[tuple[float, float]]:
        """The waits kept: (wall seconds, communication threads' CPU seconds) per end of
        backward."""
        return list(self._waits)


def spare_cores() -> bool:
    """Whether each thread of the ranks on this machine has a core of its own: the
    ranks here (``LOCAL_WORLD_SIZE``, which torchrun sets; else every rank of the
    default group) times torch's threads, against the cores this process may run on
    (or, where it is pinned to fewer than the machine has, its threads against those).
    Where they do not, a spinning wait takes a core another rank needs: measured on
    torch 2.13, 4 gloo ranks on 2 cores, 400 buckets, "after": 2151-2362 ms per step
    spinning against 1582-1679 blocking."""
    machine = os.cpu_count() or 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        cores = machine
    threads = torch.get_num_threads()
    if cores < machine:  # pinned: this rank's own cores
        return threads <= cores
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    local = int(raw) if raw.isdigit() and int(raw) > 0 else ranks  # unset or not a count
    return local * threads <= cores


def _sleep_zero() -> None:
    time.sleep(0)


def mean_bucket_bytes(pending: Iterable[tuple[Any, Any]]) -> float:
    """The mean size in bytes of the buckets of ``pending`` ((bucket, future) pairs)."""
    buffers = [bucket.buffer() for bucket, _ in pending]
    return sum(b.numel() * b.element_size() for b in buffers) / max(len(buffers), 1)


def block_on(future: Any, blocked: list[float], spin: bool = True) -> None:
    """Wait for ``future`` (a reduction's) if it is not done, adding the wall seconds
    spent, and the CPU seconds the communication threads spent meanwhile
    (:data:`~overlapkit.overlap.ddp.comm_threads.COMM_THREADS`), to
    ``blocked``: what :meth:`InlineSchedule.ended` is told. A failed reduction is not
    raised here: it raises again where its bucket is stepped, and is kept there
    (``FailedReductions.reduced``).

    With ``spin``, the thread keeps its core for up to :data:`SPIN` seconds, yielding
    it to any thread ready to run (``os.sched_yield``, without the GIL), before it
    blocks. A blocked thread gives its core up, and where the reductions are work
    for this machine's cores (ranks on one machine, gloo's threads passing each
    bucket between them) every reduction then waits for a core to wake: measured on
    torch 2.13, 2 gloo ranks on a 2-core VM, 400 buckets of 16 KiB took 290 ms to
    reduce and step blocked, as plain DDP's own wait does, and 96-112 ms spinning; 100
    buckets of 256 KiB 95 against 85 ms; 6 of 4 MiB 51 against 47 ms
    (``docs/benchmarks.md``).
    """
    if future.done():
        return
    started = time.perf_counter()
    others_started = COMM_THREADS.cpu_seconds()
    if spin:
        deadline = started + SPIN
        pause = getattr(os, "sched_yield", _sleep_zero)  # not on Windows
        while not future.done() and time.perf_counter() < deadline:
            pause()
    if not future.done():
        with suppress(Exception):
            future.wait()
    blocked[0] += time.perf_counter() - started
    blocked[1] += COMM_THREADS.cpu_seconds() - others_started
