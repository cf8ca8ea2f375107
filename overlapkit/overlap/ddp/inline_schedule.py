"""When a CPU rank steps its buckets at the end of backward: while the reductions still
in flight complete, or once they all have. Chosen by what the rank's communication
does while the rank waits for it.

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

Where the reductions are themselves work for this machine's cores — ranks on one
machine reducing over loopback, gloo's threads copying and summing — stepping beside
them slows every reduction down: measured, 2 ranks on 2 cores, 100 buckets, 1.30 x the
plain step with ``"fill"`` and 1.07 x with ``"after"``; gloo's network thread used
twice the CPU time. A rank cannot tell the two apart from wall-clock time (what it
waits for is also when its peers arrive, which varies far more from step to step than
the difference), but it can tell from CPU time: whenever it blocks waiting for a
reduction, it measures the CPU time its own process spends meanwhile — its
communication threads', since the training thread only waits. Where, over its last
:data:`TRIALS` ends of backward, that kept at least :data:`BUSY` of a core busy, the
reductions are CPU work and the order is ``"after"``; otherwise the waits are idle and
it is ``"fill"`` (measured: 0.38-0.79 of a core over loopback, 2 ranks on 2 cores;
0.04-0.07 over the simulated link, whose transfers take no CPU time, as a network
card's). It is ``"after"`` until measured, and follows the measurements from then on
(the network a run uses can change: another job on it, a benchmark's next row). A rank
whose reductions are always complete by the end of backward (one rank, or a network
faster than backward) never blocks and has nothing to choose: both orders are then the
same. The order changes only timings: both step the same parameters with the same
gradients.

.. versionadded:: 0.4
"""

from __future__ import annotations

from collections import deque

__all__ = ["AFTER", "BUSY", "FILL", "TRIALS", "InlineSchedule"]

FILL = "fill"
AFTER = "after"
#: the ends of backward whose waits decide the order
TRIALS = 3
#: the share of a core the process keeps busy while it waits, from which its
#: reductions count as CPU work
BUSY = 0.25
#: ends of backward not measured first (DDP rebuilds its buckets after the first
#: iteration; the first steps create the optimizer's state)
_SKIPPED = 2


class InlineSchedule:
    """The order of one CPU bucket stepper's steps at the end of backward."""

    def __init__(self) -> None:
        #: the order the last :data:`TRIALS` measured ends of backward give (None
        #: until there are that many)
        self.chosen: str | None = None
        self._seen = 0
        #: (wall seconds, process CPU seconds) blocked waiting, per end of backward
        self._waits: deque[tuple[float, float]] = deque(maxlen=TRIALS)

    def order(self) -> str:
        """The order for this end of backward, where reductions are still in flight."""
        return AFTER if self.chosen is None else self.chosen

    def waited(self, wall_s: float, cpu_s: float) -> None:
        """At one end of backward, the rank blocked ``wall_s`` seconds in all waiting for
        reductions, and its process used ``cpu_s`` seconds of CPU time meanwhile."""
        self._seen += 1
        if self._seen <= _SKIPPED or wall_s <= 0:
            return
        self._waits.append((wall_s, cpu_s))
        if len(self._waits) == TRIALS:
            self.chosen = AFTER if self.busy >= BUSY else FILL

    @property
    def busy(self) -> float:
        """The share of a core the process kept busy over the waits kept."""
        wall = sum(wall for wall, _ in self._waits)
        return sum(cpu for _, cpu in self._waits) / wall if wall > 0 else 0.0

    @property
    def waits(self) -> list[tuple[float, float]]:
        """The waits kept: (wall seconds, process CPU seconds) per end of backward."""
        return list(self._waits)
