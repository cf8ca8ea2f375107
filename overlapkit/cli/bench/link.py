"""A simulated network link for the benchmarks: a DDP comm hook that completes each
bucket's future no earlier than a ring allreduce over a slower link would.

Why: on one machine the ranks reduce over loopback in microseconds, so there is nothing
for the optimizer step to hide behind; the network-bound benchmark
(:mod:`overlapkit.cli.bench.network_bound`) needs the communication of a cluster.

The model (:meth:`SimulatedLink.ring_allreduce_s`): a ring allreduce of ``n`` bytes over
``ranks`` ranks sends ``2 (ranks - 1) / ranks x n`` bytes per rank in ``2 (ranks - 1)``
steps, each paying the link's latency: ``t = 2 (ranks - 1) x latency + 2 (ranks - 1) /
ranks x 8 n / bandwidth``. The link is serial: a bucket's transfer starts when the hook
is called or when the previous transfer ends, whichever is later (one ``free_at`` time
per link, per process).

The real allreduce still runs first (the gradients are the real averages); the future
DDP receives completes at ``max(real allreduce done, modelled transfer end)``:

- on CPU a single timer thread (:class:`Alarm`) sleeps on a condition variable until
  the transfer ends and then sets the result: no core is used while the link is busy
  (a busy wait would take the core the backward runs on);
- on CUDA the delay is a ``torch.cuda._sleep`` kernel on one link stream per process,
  enqueued after the allreduce: the link stream serialises the transfers and the host
  never waits.

The hook is a regular comm-hook plugin (``simulated_link``, :func:`register`), so
``overlap_ddp(..., comm_hook="simulated_link", comm_hook_options={"link": link})`` and
plain DDP (``register_comm_hook(*link_hook(link))``) run the same link.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from overlapkit.comm_hooks import allreduce_hook
from overlapkit.errors import ConfigurationError
from overlapkit.plugin.hookspecs import hookimpl
from overlapkit.plugin.manager import get_plugin_manager
from overlapkit.plugin.records import CommHookRecord

__all__ = ["HOOK_NAME", "Alarm", "SimulatedLink", "link_hook", "register"]

#: the name the hook is registered under (:func:`register`)
HOOK_NAME = "simulated_link"


class Alarm:
    """One daemon thread that runs callbacks at given ``time.monotonic()`` deadlines,
    sleeping on a condition variable in between (no busy wait)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="simulated-link",
                                        daemon=True)
        self._thread.start()

    def at(self, deadline: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the alarm thread at ``deadline`` (now if it has passed)."""
        with self._wake:
            heapq.heappush(self._heap, (deadline, next(self._order), callback))
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._wake.wait(timeout)
                _, _, callback = heapq.heappop(self._heap)
            callback()  # outside the lock: a callback may schedule another


_ALARM: tuple[int, Alarm] | None = None


def alarm() -> Alarm:
    """This process's alarm thread, started on first use (a forked rank starts its own)."""
    global _ALARM
    if _ALARM is None or _ALARM[0] != os.getpid():
        _ALARM = (os.getpid(), Alarm())
    return _ALARM[1]


@attrs.define(kw_only=True)
class SimulatedLink:
    """A serial link of ``gbps`` gigabits per second and ``latency_us`` per message,
    carrying ring allreduces among ``ranks`` ranks. Change :attr:`gbps` between
    measurements to run the same models over another link speed."""

    gbps: float = attrs.field(validator=attrs.validators.gt(0))
    latency_us: float = attrs.field(default=10.0, validator=attrs.validators.ge(0))
    ranks: int = attrs.field(default=8, validator=attrs.validators.ge(2))
    #: when the transfers queued so far end (``time.monotonic()``)
    free_at: float = attrs.field(default=0.0, init=False)
    #: modelled transfer time queued so far (s), and the number of transfers
    modelled_s: float = attrs.field(default=0.0, init=False)
    transfers: int = attrs.field(default=0, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _stream: Any = attrs.field(default=None, init=False, repr=False)
    _cycles_per_s: float = attrs.field(default=0.0, init=False, repr=False)

    def ring_allreduce_s(self, nbytes: int) -> float:
        """Seconds a ring allreduce of ``nbytes`` takes on this link (see the module)."""
        steps = 2 * (self.ranks - 1)
        return (steps * self.latency_us * 1e-6
                + steps / self.ranks * 8 * nbytes / (self.gbps * 1e9))

    def reserve(self, nbytes: int, now: float | None = None) -> float:
        """Queue a transfer of ``nbytes`` issued at ``now``; return when it ends."""
        now = time.monotonic() if now is None else now
        seconds = self.ring_allreduce_s(nbytes)
        with self._lock:
            start = max(now, self.free_at)
            self.free_at = start + seconds
            self.modelled_s += seconds
            self.transfers += 1
            return self.free_at

    def take_counts(self) -> tuple[float, int]:
        """The modelled seconds and transfers since the last call; resets them."""
        with self._lock:
            counts = (self.modelled_s, self.transfers)
            self.modelled_s, self.transfers = 0.0, 0
            return counts

    def delayed(self, reduced: torch.futures.Future[Any], nbytes: int,
                device: torch.device) -> torch.futures.Future[Any]:
        """``reduced``, completing no earlier than the transfer of ``nbytes`` queued now."""
        if device.type == "cuda":
            return self._delayed_on_stream(reduced, nbytes, device)
        deadline = self.reserve(nbytes)
        out: torch.futures.Future[Any] = torch.futures.Future()

        def arrived(fut: torch.futures.Future[Any]) -> None:
            try:
                value = fut.value()
            except Exception as error:  # the allreduce failed: DDP raises it
                out.set_exception(error)
                return
            if time.monotonic() >= deadline:
                out.set_result(value)
            else:
                alarm().at(deadline, lambda: out.set_result(value))

        reduced.add_done_callback(arrived)
        return out

    def _delayed_on_stream(self, reduced: torch.futures.Future[Any], nbytes: int,
                           device: torch.device) -> torch.futures.Future[Any]:
        seconds = self.ring_allreduce_s(nbytes)
        with self._lock:
            self.modelled_s += seconds
            self.transfers += 1
        cycles = int(seconds * self.cycles_per_s(device))
        stream = self._stream

        def after(fut: torch.futures.Future[Any]) -> Any:
            # The callback runs on a stream that waited for the allreduce; the link
            # stream waits for it, sleeps (after the transfers queued before), and the
            # future's own completion then waits for the link stream.
            current = torch.cuda.current_stream(device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
            current.wait_stream(stream)
            return fut.value()

        return reduced.then(after)

    def cycles_per_s(self, device: torch.device) -> float:
        """The GPU clock as ``torch.cuda._sleep`` counts it, measured once per link."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
            with torch.cuda.stream(self._stream):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                torch.cuda._sleep(1_000_000)  # warm-up
                start.record()
                torch.cuda._sleep(10_000_000)
                end.record()
            end.synchronize()
            self._cycles_per_s = 10_000_000 / (start.elapsed_time(end) / 1000)
        return self._cycles_per_s


@attrs.frozen
class _HookState:
    link: SimulatedLink
    inner_state: Any
    inner_hook: Callable[..., Any]


def _simulated_link_hook(state, bucket):  # type: ignore[no-untyped-def]
    # Unannotated: DDP checks a registered hook's annotations (see allreduce_hook).
    buffer = bucket.buffer()
    reduced = state.inner_hook(state.inner_state, bucket)
    return state.link.delayed(reduced, buffer.numel() * buffer.element_size(),
                              buffer.device)


def link_hook(link: SimulatedLink, *, process_group: Any = None
              ) -> tuple[_HookState, Callable[..., Any]]:
    """``(state, hook)`` for ``register_comm_hook``: overlapkit's ``allreduce``, delayed
    by ``link``."""
    return _HookState(link, process_group, allreduce_hook), _simulated_link_hook


def _build(*, process_group: Any = None, link: SimulatedLink | None = None
           ) -> tuple[_HookState, Callable[..., Any]]:
    if not isinstance(link, SimulatedLink):
        raise ConfigurationError(
            "comm hook 'simulated_link' needs comm_hook_options={'link': "
            f"SimulatedLink(gbps=...)}}, got link={link!r}.")
    return link_hook(link, process_group=process_group)


class _Plugin:
    """The plugin :func:`register` adds: the ``simulated_link`` comm hook."""

    @staticmethod
    @hookimpl
    def overlapkit_register_comm_hooks() -> list[CommHookRecord]:
        return [CommHookRecord(name=HOOK_NAME, build=_build,
                               description="allreduce, then a simulated ring allreduce "
                                           "on a serial link (benchmarks)")]


def register() -> None:
    """Register the ``simulated_link`` comm hook in this process (once; a benchmark's
    ranks call it before ``overlap_ddp(..., comm_hook="simulated_link")``)."""
    manager = get_plugin_manager()
    if not manager.has_plugin(HOOK_NAME):
        manager.register(_Plugin, name=HOOK_NAME)
