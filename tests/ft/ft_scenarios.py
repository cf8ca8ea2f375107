"""Fault-tolerance runs for tests/ft and benchmarks/ft.py: a Lighthouse in this process,
one process per replica group (tests/ft/replica.py), a kill by SIGKILL and a restart.

A scenario returns each replica's result (final parameters, step and averaging times)
under a label: ``"0"`` and ``"1"`` for the two replica groups, ``"1b"`` for replica 1
restarted after its kill. Every wait has a timeout, so a broken run fails, never hangs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

REPO = Path(__file__).resolve().parents[2]
REPLICA = Path(__file__).with_name("replica.py")
PERIOD, SYNCS = 3, 6
#: the survivor's wait for a dead replica's heartbeat to expire (torchft's default is 5 s)
HEARTBEAT_TIMEOUT_MS = 1000


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

    @property
    def name(self) -> str:
        return f"{self.impl}-{self.averager}-{self.failure or 'none'}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env() -> dict[str, str]:
    paths = [str(REPO), str(REPO / "plugins" / "overlapkit-diloco" / "src")]
    old = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths + ([old] if old else [])),
                OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run(scenario: Scenario, workdir: Path, timeout: float = 150.0) -> dict[str, Any]:
    """Run ``scenario`` in ``workdir``; return ``{label: result}`` plus ``"killed_at"``
    (the victim's clock just before its SIGKILL) for the failure scenarios.

    :raises RuntimeError: a replica exited with an error or a wait timed out; the
        message holds the end of its log.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    lighthouse = None
    common = [sys.executable, str(REPLICA), "--impl", scenario.impl, "--averager",
              scenario.averager, "--period", str(scenario.period), "--syncs",
              str(scenario.syncs)]
    if scenario.impl == "plain":
        common += ["--init-method", f"tcp://127.0.0.1:{_free_port()}"]
    else:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=30000,
                                      heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
        common += ["--lighthouse", lighthouse.address()]
    ready = [str(workdir / f"ready{r}") for r in (0, 1)]
    processes: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}

    def start(label: str, replica: int, extra: list[str]) -> None:
        logs[label] = workdir / f"replica{label}.log"
        with logs[label].open("wb") as log:
            processes[label] = subprocess.Popen(
                [*common, "--replica", str(replica), "--out", str(workdir / f"{label}.pt"),
                 *extra], env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    deadline = time.monotonic() + timeout
    try:
        barrier = ["--barrier", *ready]
        survivor = list(barrier)
        victim = list(barrier)
        if scenario.failure == "kill":
            survivor += ["--wait-at", "4"]
            victim += ["--kill-after", "7"]
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
            if process.poll() is None:
                process.kill()
                process.wait()
        if lighthouse is not None:
            lighthouse.shutdown()
    results: dict[str, Any] = {label: torch.load(workdir / f"{label}.pt")
                               for label in processes
                               if not (label == "1" and scenario.failure)}
    if scenario.failure:
        results["killed_at"] = float((workdir / "1.pt.killed").read_text())
    return results


def _wait(process: subprocess.Popen[bytes], deadline: float, log: Path,
          expect_killed: bool) -> None:
    try:
        code = process.wait(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise RuntimeError(f"replica timed out; end of {log.name}:\n"
                           + log.read_text(errors="replace")[-3000:]) from None
    if code != (-9 if expect_killed else 0):
        raise RuntimeError(f"replica exited with {code}; end of {log.name}:\n"
                           + log.read_text(errors="replace")[-3000:])
