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

Which is faster depends on what the reductions wait for, which a rank cannot see
directly:

- over a network (or for a slower peer) the wait is idle, and ``"fill"`` hides the
  steps in it;
- where the reductions are themselves work for this machine's cores — ranks on one
  machine reducing over loopback, gloo's threads copying and summing — stepping
  beside them slows them down, and the steps gain little or lose (measured on torch
  2.13, 2 ranks on a 2-core VM, waiting as :func:`block_on` waits, ms per training
  step: 400 buckets of 16 KiB "after" 92, "fill" 118; 100 of 256 KiB 85 and 98; 50 of
  1 MiB 107 and 106-112; 6 of 4 MiB 47-48 either way).

So the rank measures. Whenever it waits for a reduction, it notes the CPU time its
process's other threads (its communication threads) spend meanwhile. Where, over its
last :data:`TRIALS` ends of backward, that kept less than :data:`BUSY` of a core busy,
the wait is idle and the order is ``"fill"`` (measured: 0.04-0.07 of a core over the
simulated link, whose transfers take no CPU time, as a network card's; 0.3-0.9 over
loopback). Otherwise it times its ends of backward (from the end of backward's
computation to the last step) in each order in turn, :data:`TIMED` of each, and keeps
``"fill"`` only where its turns were the faster in at least :data:`FILL_WINS` of the
pairs of one turn of each order (a rank-sum comparison, Mann-Whitney's: a difference
that is only noise passes it about 7 % of the time); otherwise ``"after"``. Wall-clock
time alone would not do: the wait also depends on when the peers arrive, which varies
far more between steps (10-37 ms on the 6 buckets above) than the orders differ, so
that the shorter median of five turns picked the slower order on 100 buckets in 4 of
6 rank-runs; ``"after"`` is kept where the turns cannot tell, since over loopback it
was never the slower by more than noise. Until measured, and while the first
measurements are taken, the order is ``"after"``. The busy share is followed from then
on: a network that gets busy or idle again changes the order. A rank whose reductions
are always complete by the end of backward (one rank, or a network faster than
backward) never waits and has nothing to choose: both orders are then the same. The
order changes only timings: both step the same parameters with the same gradients.

.. versionadded:: 0.4
"""

from __future__ import annotations

import os
import time
from collections import deque
from contextlib import suppress
from typing import Any

__all__ = ["AFTER", "BUSY", "FILL", "FILL_WINS", "SETTLED", "SPIN", "TIMED", "TRIALS",
           "InlineSchedule", "block_on"]

FILL = "fill"
AFTER = "after"
#: the ends of backward whose waits say whether the reductions are CPU work
TRIALS = 3
#: the share of a core the process keeps busy while it waits, from which its
#: reductions count as CPU work
BUSY = 0.25
#: ends of backward timed in each order where they are (alternating)
TIMED = 5
#: the share of the pairs (one timed turn of each order) in which "fill" must be the
#: faster for it to be kept: 20 of 25 (at most 5 pairs the other way round), which
#: orders as fast as each other reach with a probability of 0.075
FILL_WINS = 0.8
#: ends of backward not measured first (DDP rebuilds its buckets after the first
#: iteration; the first steps create the optimizer's state)
_SKIPPED = 2
#: ends of backward after which a rank has chosen its order, however busy its waits
#: (benchmarks warm up this long: the choice is a start-up cost, as DDP's rebuild)
SETTLED = _SKIPPED + TRIALS + 2 * TIMED
#: the longest a rank spins waiting for one reduction before it blocks (seconds)
SPIN = 0.05


class InlineSchedule:
    """The order of one CPU bucket stepper's steps at the end of backward."""

    def __init__(self) -> None:
        self._seen = 0
        #: (wall seconds, process CPU seconds) blocked waiting, per end of backward
        self._waits: deque[tuple[float, float]] = deque(maxlen=TRIALS)
        #: the ends of backward timed in each order (seconds), while the waits are busy
        self._times: dict[str, list[float]] = {FILL: [], AFTER: []}
        #: the faster order of the timed ones, once timed
        self.faster: str | None = None
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
        return self.busy_waits is not False

    @property
    def chosen(self) -> str | None:
        """The order chosen by the measurements so far (None while they are taken)."""
        if self.fixed is not None:
            return self.fixed
        busy = self.busy_waits
        if busy is None:
            return None
        return self.faster if busy else FILL

    def order(self) -> str:
        """The order for this end of backward, where reductions are still in flight."""
        chosen = self.chosen
        if chosen is not None:
            return chosen
        if not self.busy_waits:
            return AFTER  # not measured yet: the waits are measured in the plain order
        times = self._times  # busy waits, not timed yet: the orders take turns
        return FILL if len(times[FILL]) <= len(times[AFTER]) else AFTER

    def ended(self, order: str, seconds: float, blocked_s: float, cpu_s: float) -> None:
        """An end of backward in ``order`` took ``seconds``, of which the rank blocked
        ``blocked_s`` in all waiting for reductions, while its process used ``cpu_s``
        seconds of CPU time."""
        if self.fixed is not None:
            return
        timing = self.busy_waits and self.faster is None
        self._seen += 1
        if self._seen <= _SKIPPED:
            return
        if blocked_s > 0:
            self._waits.append((blocked_s, cpu_s))
        if not timing:
            return
        times = self._times
        times[order].append(seconds)
        if min(len(times[FILL]), len(times[AFTER])) >= TIMED:
            self.faster = FILL if fill_wins(times[FILL], times[AFTER]) else AFTER

    @property
    def busy(self) -> float:
        """The share of a core the process kept busy over the waits kept."""
        wall = sum(wall for wall, _ in self._waits)
        return sum(cpu for _, cpu in self._waits) / wall if wall > 0 else 0.0

    @property
    def waits(self) -> list[tuple[float, float]]:
        """The waits kept: (wall seconds, process CPU seconds) per end of backward."""
        return list(self._waits)

    @property
    def trials(self) -> dict[str, list[float]]:
        """The ends of backward timed in each order (seconds)."""
        return {order: list(times) for order, times in self._times.items()}


def fill_wins(fill: list[float], after: list[float]) -> bool:
    """Whether the turns in ``"fill"`` order were the faster in at least
    :data:`FILL_WINS` of the pairs of one turn of each order (a tie counts half)."""
    faster = sum(1.0 if f < a else 0.5 if f == a else 0.0 for f in fill for a in after)
    return faster >= FILL_WINS * len(fill) * len(after)


def block_on(future: Any, blocked: list[float], spin: bool = True) -> None:
    """Wait for ``future`` (a reduction's) if it is not done, adding the wall seconds
    spent, and the CPU seconds the process's other threads spent meanwhile, to
    ``blocked``: what :meth:`InlineSchedule.ended` is told. A failed reduction is not
    raised here: it raises again where its bucket is stepped, and is kept there
    (``FailedReductions.reduced``).

    With ``spin``, the thread keeps its core for up to :data:`SPIN` seconds, yielding
    it to any thread ready to run (``os.sched_yield``, without the GIL), before it
    blocks. A blocked thread gives its core up, and where the reductions are work
    for this machine's cores (ranks on one machine, gloo's threads passing each
    bucket between them) every reduction then waits for a core to wake: measured on
    torch 2.13, 2 gloo ranks on a 2-core VM, 400 buckets of 16 KiB took 290 ms to
    reduce and step blocked, as plain DDP's own wait does, and 92 ms spinning; 100
    buckets of 256 KiB 95 against 85 ms; 6 of 4 MiB 51 against 47 ms
    (``docs/benchmarks.md``).
    """
    if future.done():
        return
    started = time.perf_counter()
    others_started = time.process_time() - time.thread_time()
    if spin:
        deadline = started + SPIN
        while not future.done() and time.perf_counter() < deadline:
            os.sched_yield()
    if not future.done():
        with suppress(Exception):
            future.wait()
    blocked[0] += time.perf_counter() - started
    blocked[1] += time.process_time() - time.thread_time() - others_started
