"""The CPU time of this process's communication threads, which tells a CPU rank whether
the reductions it waits for are work for this machine's cores (loopback, ranks on one
machine) or wait for a network (:mod:`~overlapkit.overlap.ddp.inline_schedule`).

gloo names its threads ``gloo_tcp_loop`` and ``pt_gloo_runloop`` (torch 2.13). Their
CPU clocks are read directly (Linux: ``clock_gettime`` on a thread's CPU clock, whose
id follows from the thread's id; nanoseconds, 0.3 us a read), not as the process's CPU
time less the waiting thread's: that also counts torch's intra-op worker threads,
which keep spinning for milliseconds after each parallel kernel (measured on torch
2.13 with 2 threads: an idle wait of 5-20 ms right after one elementwise op read
0.25-0.8 of a core busy), so that a wait for a network read as loopback work. Where
no such thread is found (another platform, another backend), the process's CPU time
less the waiting thread's is what is left.

.. versionadded:: 0.4
"""

from __future__ import annotations

import os
import time
from contextlib import suppress

__all__ = ["COMM_THREADS", "CommThreads"]

#: the names (prefixes) of the process group's threads
_NAMES = ("gloo", "pt_gloo")
_TASKS = "/proc/self/task"


def _cpu_clock(tid: int) -> int:
    """The id of thread ``tid``'s CPU clock (Linux: MAKE_THREAD_CPUCLOCK(tid, SCHED))."""
    return (~tid << 3) | 6


class CommThreads:
    """The communication threads of this process, found by name (:meth:`refresh`)."""

    def __init__(self) -> None:
        #: the threads' CPU clocks (empty: none found, the fallback is used)
        self.clocks: list[int] = []
        self._seen = -1  # how many threads the process had at the last scan

    def refresh(self) -> None:
        """Find the communication threads again if the process's threads changed
        (one directory listing; a scan reads each thread's name)."""
        with suppress(OSError):
            tids = os.listdir(_TASKS)
            if len(tids) == self._seen:
                return
            self._seen = len(tids)
            clocks = []
            for tid in tids:
                with suppress(OSError), open(f"{_TASKS}/{tid}/comm") as name:
                    if name.read().startswith(_NAMES):
                        clocks.append(_cpu_clock(int(tid)))
            self.clocks = clocks

    def cpu_seconds(self) -> float:
        """The communication threads' CPU time so far (s); without any, the process's
        CPU time less the calling thread's. Only differences mean anything."""
        clocks = self.clocks
        if clocks:
            with suppress(OSError):
                return sum(time.clock_gettime(clock) for clock in clocks)
        return time.process_time() - time.thread_time()


#: the process's communication threads (one process, one set)
COMM_THREADS = CommThreads()
