"""Fault-tolerance runs for tests/ft and benchmarks/ft.py: a Lighthouse in this process,
one process per replica group (tests/ft/replica.py), a kill by SIGKILL and a restart.

The replica processes are forked from a multiprocessing fork server that imported
torch, torchft and overlapkit once: importing them costs about 2.5 s of CPU per
process (measured), which 30 processes on 2 cores would pay one after another.

A scenario returns each replica's result (final parameters, step and averaging times)
under a label: ``"0"`` and ``"1"`` for the two replica groups, ``"1b"`` for replica 1
restarted after its kill. Every wait has a timeout, so a broken run fails, never hangs.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

REPLICA = Path(__file__).with_name("replica.py")
PERIOD, SYNCS = 3, 6
#: the survivor's wait for a dead replica's heartbeat to expire (torchft's default is 5 s)
HEARTBEAT_TIMEOUT_MS = 1000
#: the "kill" scenario's victim dies after its step 7: in the third round
KILLED_IN_ROUND = 3


def next_averaging(result: dict[str, Any], round_: int) -> float:
    """When ``result``'s replica finished the averaging that ends round ``round_``."""
    return next(ended for committed, _, ended in result["timings"]["syncs"]
                if committed == round_)


@attrs.frozen(kw_only=True)
class Scenario:
    """One run: the implementation, the averager and the failure injected.

    ``failure``: ``None``; ``"kill"`` (replica 1 SIGKILLed after its step 7, between
    averagings, then restarted once the survivor has committed 4 averagings);
    ``"kill-in-averaging"`` (replica 1 SIGKILLed right after the quorum of its third
    averaging, so the survivor's averaging fails and is not committed).
    """

    impl: str
    averager: str = "periodic"
    failure: str | None = None
    period: int = PERIOD
    syncs: int = SYNCS
    #: Streaming DiLoCo's fragments (1 or 2: the MLP's two Linear layers)
    fragments: int = 1
    #: Streaming DiLoCo's fragment_sync_delay and fragment_update_alpha
    delay: int = 0
    alpha: float = 0.0

    @property
    def name(self) -> str:
        streaming = f"-{self.fragments}fragments" if self.fragments > 1 else ""
        if self.delay or self.alpha:
            streaming += f"-delay{self.delay}-alpha{self.alpha}"
        return f"{self.impl}-{self.averager}{streaming}-{self.failure or 'none'}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _replica_process(argv: list[str], log: str) -> None:
    """A replica group's process: its output to ``log``, then tests/ft/replica.py."""
    with open(log, "ab", buffering=0) as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    import replica

    replica.main(argv)
    sys.stdout.flush()


def _context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torchft.manager", "torchft.local_sgd",
                                    "overlapkit", "overlapkit.ft.optimizer", "replica"])
    return context


def run(scenario: Scenario, workdir: Path, timeout: float = 150.0) -> dict[str, Any]:
    """Run ``scenario`` in ``workdir``; return ``{label: result}`` plus ``"killed_at"``
    (the victim's clock just before its SIGKILL) for the failure scenarios.

    :raises RuntimeError: a replica exited with an error or a wait timed out; the
        message holds the end of its log.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    lighthouse = None
    if str(REPLICA.parent) not in sys.path:  # the fork server imports replica.py
        sys.path.insert(0, str(REPLICA.parent))
    context = _context()
    common = ["--impl", scenario.impl, "--averager",
              scenario.averager, "--period", str(scenario.period), "--syncs",
              str(scenario.syncs), "--fragments", str(scenario.fragments),
              "--sync-delay", str(scenario.delay), "--alpha", str(scenario.alpha)]
    if scenario.impl == "plain":
        common += ["--init-method", f"tcp://127.0.0.1:{_free_port()}"]
    else:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=30000,
                                      heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
        common += ["--lighthouse", lighthouse.address()]
    ready = [str(workdir / f"ready{r}") for r in (0, 1)]
    processes: dict[str, Any] = {}
    logs: dict[str, Path] = {}

    def start(label: str, replica: int, extra: list[str]) -> None:
        logs[label] = workdir / f"replica{label}.log"
        argv = [*common, "--replica", str(replica), "--out", str(workdir / f"{label}.pt"),
                *extra]
        processes[label] = context.Process(target=_replica_process,
                                           args=(argv, str(logs[label])))
        processes[label].start()

    deadline = time.monotonic() + timeout
    try:
        barrier = ["--barrier", *ready]
        survivor = list(barrier)
        victim = list(barrier)
        if scenario.failure == "kill":
            survivor += ["--wait-at", "4"]
            victim += ["--kill-after", str(PERIOD * (KILLED_IN_ROUND - 1) + 1)]
        elif scenario.failure == "kill-in-averaging":
            victim += ["--kill-in-quorum", "3"]
        start("0", 0, ["--ready", ready[0], *survivor])
        start("1", 1, ["--ready", ready[1], *victim])
        if scenario.failure == "kill":
            _wait(processes["1"], deadline, logs["1"], expect_killed=True)
            start("1b", 1, ["--ready", str(workdir / "ready1b")])
        for label, process in processes.items():
            _wait(process, deadline, logs[label],
                  expect_killed=label == "1" and scenario.failure is not None)
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
                process.join()
        if lighthouse is not None:
            lighthouse.shutdown()
    results: dict[str, Any] = {label: torch.load(workdir / f"{label}.pt")
                               for label in processes
                               if not (label == "1" and scenario.failure)}
    if scenario.failure:
        results["killed_at"] = float((workdir / "1.pt.killed").read_text())
    return results


def _wait(process: Any, deadline: float, log: Path, expect_killed: bool) -> None:
    process.join(timeout=max(deadline - time.monotonic(), 1.0))
    if process.is_alive():
        process.kill()
        process.join()
        raise RuntimeError(f"replica timed out; end of {log.name}:\n"
                           + log.read_text(errors="replace")[-3000:])
    if process.exitcode != (-9 if expect_killed else 0):
        raise RuntimeError(f"replica exited with {process.exitcode}; end of {log.name}:\n"
                           + log.read_text(errors="replace")[-3000:])
