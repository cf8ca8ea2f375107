"""torchrun agents on loopback, each its own "node", as users start them on machines.

Each agent is ``python -m torch.distributed.run --nnodes N --nproc-per-node P
--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT ...`` in a process of its own, as
each machine of a job runs its own. The first agent starts alone and the others once
it listens on the rendezvous port, so it keeps the rendezvous store and has the lowest
pid: c10d gives it node 0 (GROUP_RANK 0, ranks 0..P-1), where torchrun's own store for
the workers lives too. A lost node in these tests is therefore never node 0: c10d's
rendezvous does not survive the loss of the node keeping its store (docs/nodes.rst).

Every wait has a deadline, and :meth:`Job.stop` kills every agent and its workers, so
a broken agent fails a test instead of hanging it. Runs are judged by their output, as
``tests/test_readme.py`` judges its own: gloo may abort a rank at interpreter exit after
all its work is done.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from overlapkit.distributed import free_port

#: what a process aborted by gloo at interpreter exit prints (std::terminate)
EXIT_ABORT = "terminate called without an active exception"

#: rendezvous settings that end a failing rendezvous in well under a minute (the
#: defaults wait 10 minutes for missing nodes)
RDZV_CONF = "join_timeout=60,close_timeout=10,read_timeout=20"


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(entry))
    return found


def kill_node(pid: int) -> None:
    """SIGKILL an agent and every worker it started (torchrun starts each worker in a
    session of its own, so killing the agent alone would leave them running)."""
    for worker in children(pid):
        _kill(worker)
    _kill(pid)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


class Agent:
    """One torchrun agent: its process, where its output goes, when it ended."""

    def __init__(self, proc: subprocess.Popen[bytes], out: Path, err: Path) -> None:
        self.proc = proc
        self.out = out
        self.err = err
        self.started = time.time()
        #: when the process ended (``time.time()``), seen by a thread waiting on it
        self.ended: float | None = None
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        self.proc.wait()
        self.ended = time.time()

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def kill(self) -> None:
        """Kill the agent and its workers, and wait for it to end."""
        kill_node(self.proc.pid)
        self.proc.wait()

    def wait(self, deadline: float) -> int | None:
        """The exit code, or ``None`` if it has not ended by ``deadline`` (monotonic)."""
        self._watcher.join(max(0.0, deadline - time.monotonic()))
        return None if self._watcher.is_alive() else self.proc.returncode


class Job:
    """A job of torchrun agents on 127.0.0.1: ``--nnodes len(nodes)``, one agent per
    entry of ``nodes`` with that many ranks."""

    def __init__(self, entrypoint: Sequence[str], nodes: Sequence[int], directory: Path, *,
                 env: Mapping[str, str] | None = None, max_restarts: int = 0,
                 name: str = "job", wrap: Callable[[int], list[str]] | None = None) -> None:
        self.entrypoint = list(entrypoint)
        self.nodes = list(nodes)
        self.directory = directory
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        self.max_restarts = max_restarts
        self.name = name
        self.port = rendezvous_port()
        #: agent index -> a command the agent runs under (its own mounts, say)
        self.wrap = wrap
        self.agents: list[Agent] = []

    def start_agent(self, nproc: int) -> Agent:
        """Start one agent (a node) of the job."""
        index = len(self.agents)
        out = self.directory / f"{self.name}-agent{index}.out"
        err = self.directory / f"{self.name}-agent{index}.err"
        argv = [sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(len(self.nodes)), "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                "--rdzv-id", self.name, "--rdzv-conf", RDZV_CONF,
                "--max-restarts", str(self.max_restarts), *self.entrypoint]
        if self.wrap is not None:
            argv = [*self.wrap(index), *argv]  # it must exec the agent (its pid is kept)
        with out.open("wb") as stdout, err.open("wb") as stderr:
            proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=self.env,
                                    cwd=self.directory, start_new_session=True)
        agent = Agent(proc, out, err)
        self.agents.append(agent)
        return agent

    def start(self) -> Job:
        """Start every agent: the first alone, the others once it keeps the store."""
        first = self.start_agent(self.nodes[0])
        deadline = time.monotonic() + 60
        while not _listening(self.port):
            if first.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the first agent did not open the rendezvous:\n"
                                     f"{first.stderr[-3000:]}")
            time.sleep(0.05)
        for nproc in self.nodes[1:]:
            self.start_agent(nproc)
        return self

    def wait(self, timeout: float = 240, *, done: Callable[[], bool] | None = None
             ) -> list[int]:
        """Every agent's exit code; kills the job and fails if one has not ended within
        ``timeout`` seconds.

        With ``done`` (the job's work is done, an agent failed at exit), an agent whose
        workers have all ended is waiting in torchrun's exit barrier for the failed one
        (5 minutes, not configurable from the command line): it is stopped then, its code
        -9, instead of failing the test after ``timeout``."""
        deadline = time.monotonic() + timeout
        while any(agent.ended is None for agent in self.agents):
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(
                    f"{self.name}: agents still running after {timeout:.0f} s (killed):\n"
                    + "\n".join(agent.stderr[-2000:] for agent in self.agents))
            if done is not None and any(
                    agent.ended is not None and agent.proc.returncode != 0
                    for agent in self.agents) and done():
                for agent in self.agents:
                    if agent.ended is None and not children(agent.proc.pid):
                        agent.kill()
            time.sleep(0.1)
        codes = [agent.proc.returncode for agent in self.agents]  # set before .ended
        return [code for code in codes if code is not None]

    def stop(self) -> None:
        """Kill every agent of the job and its workers."""
        for agent in self.agents:
            agent.kill()

    def output(self) -> str:
        return "".join(agent.stdout for agent in self.agents)


def private_mounts() -> list[str] | None:
    """The ``unshare`` command under which a process gets mounts of its own (as root;
    else in a user namespace of its own), or ``None`` where neither may bind-mount."""
    if shutil.which("unshare") is None:
        return None
    with tempfile.TemporaryDirectory() as scratch:
        source, target = Path(scratch, "source"), Path(scratch, "target")
        source.mkdir()
        target.mkdir()
        for command in (["unshare", "--mount"], ["unshare", "--mount", "--map-root-user"]):
            probe = subprocess.run([*command, "sh", "-c", 'mount --bind "$1" "$2"', "sh",
                                    str(source), str(target)], capture_output=True)
            if probe.returncode == 0:
                return command
    return None


def own_disks(unshare: list[str], disks: Sequence[Path], at: Path
              ) -> Callable[[int], list[str]]:
    """A :class:`Job` ``wrap`` that gives agent ``i`` the directory ``disks[i]`` at the
    path ``at``: the same path on every node, each node its own disk."""

    def wrap(index: int) -> list[str]:
        return [*unshare, "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh",
                str(disks[index]), str(at)]

    return wrap


def rendezvous_port() -> int:
    """A free TCP port on 127.0.0.1 below the kernel's ephemeral range (32768 and up on
    Linux), for a job's rendezvous. ``free_port()`` returns one from that range, where
    every outgoing connection of the other tests' ranks takes its local port too: in a
    CI run (stop 52) one was taken between the choice and torchrun's bind, the first
    agent connected to that other store as a client and both agents failed at the
    rendezvous. A port below the range is only ever taken by a bind like this one."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return free_port()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_port()


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def finished(job: Job, last_line: str, *, lost: Sequence[Agent] = ()) -> None:
    """Fail unless the job printed ``last_line`` and every agent but the ``lost`` ones
    succeeded, or failed only by gloo's abort at interpreter exit after the work was
    done (torch 2.13 aborts so when a gloo thread drops a collective's tensor
    during the exit: overlapkit.nodes.exit_safe; a user's script can still end
    on such a collective of its own)."""

    def exit_abort() -> bool:
        return any(EXIT_ABORT in agent.stderr for agent in job.agents)

    codes = [code for agent, code in zip(
        job.agents, job.wait(done=lambda: last_line in job.output() and exit_abort()),
        strict=True) if agent not in lost]
    text = job.output()
    errors = "".join(agent.stderr for agent in job.agents)
    assert last_line in text, f"{job.name}: {last_line!r} not printed:\n{errors[-4000:]}"
    assert all(code == 0 for code in codes) or exit_abort(), \
        f"{job.name}: {codes}\n" + errors[-4000:]
