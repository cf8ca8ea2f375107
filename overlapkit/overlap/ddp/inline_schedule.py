"""When a CPU rank steps its buckets at the end of backward: while the reductions still
in flight complete, or once they all have. Chosen by measuring both.

On CPU the thread that steps is the thread that runs backward, so the bucket stepper
leaves every step to the end of backward's computation
(:class:`~overlapkit.overlap.ddp.bucket_stepper.BucketStepper`). What is left then is
a choice of order:

- ``"fill"``: step each run of buckets whose reduction has completed while the others
  are still in flight. This is the overlap: where the network is what the reductions
  wait for, the steps take the time the rank would otherwise spend waiting.
- ``"after"``: wait for every reduction, then step all the buckets in one call, as the
  plain loop's ``step()`` after backward does.

Which is faster depends on what the reductions wait for, which a rank cannot see. Over
a network, ``"fill"`` (measured on torch 2.13, 2 gloo ranks over a simulated 2 Gb/s
link: saves 0.8-0.9 of the plain ``step()``). Where gloo's own threads are the
bottleneck — ranks on the same machine with no core to spare for them, reducing over
loopback — stepping beside them slows every reduction (measured, 2 ranks on 2 cores,
100 buckets: 1.30 x the plain step with ``"fill"``, 1.07 x with ``"after"``; gloo's
network thread used twice the CPU time). So each rank times both on its first backwards
that end with reductions in flight (:data:`TRIALS` each, alternating) and keeps the
faster (the fastest time of each: other load only adds to them); a rank whose
reductions are always complete by then (one rank, or a network
faster than backward) has nothing to choose, and both orders are the same. The choice
changes only timings: both orders step the same parameters with the same gradients.

.. versionadded:: 0.4
"""

from __future__ import annotations

__all__ = ["AFTER", "FILL", "TRIALS", "InlineSchedule"]

FILL = "fill"
AFTER = "after"
#: timed ends of backward per order before choosing
TRIALS = 4
#: ends of backward with reductions in flight not timed first (DDP rebuilds its
#: buckets after the first iteration; the first steps create the optimizer's state)
_SKIPPED = 2


class InlineSchedule:
    """The order of one CPU bucket stepper's steps at the end of backward."""

    def __init__(self) -> None:
        #: the order chosen, once both were timed
        self.chosen: str | None = None
        self._seen = 0
        self._times: dict[str, list[float]] = {FILL: [], AFTER: []}

    def order(self) -> str:
        """The order for this end of backward, where reductions are still in flight."""
        if self.chosen is not None:
            return self.chosen
        trial = self._seen - _SKIPPED
        if trial < 0:
            return FILL
        return FILL if trial % 2 == 0 else AFTER

    def timed(self, order: str, seconds: float) -> None:
        """The end of backward in ``order`` took ``seconds`` (reductions and steps)."""
        if self.chosen is not None:
            return
        self._seen += 1
        if self._seen <= _SKIPPED:
            return
        times = self._times[order]
        times.append(seconds)
        if all(len(each) >= TRIALS for each in self._times.values()):
            # the fastest of each: a machine's other load only ever adds time
            fill, after = (min(self._times[each]) for each in (FILL, AFTER))
            self.chosen = FILL if fill <= after else AFTER

    @property
    def trials(self) -> dict[str, list[float]]:
        """The times measured so far, in seconds, per order (for benchmarks and logs)."""
        return {order: list(times) for order, times in self._times.items()}
