"""Run a function on several local gloo ranks: for tests, the demo and benchmarks.

:func:`run_distributed` spawns one process per rank on a free loopback port,
initialises a gloo process group in each, runs ``fn(rank, world_size, *args)`` and
returns every rank's result. A rank that raises makes the whole call raise
:class:`RankFailedError` with that rank's traceback; a run that does not finish in
``timeout`` seconds is killed and raises :class:`RankTimeoutError`, so a broken rank
fails a test instead of hanging it.

Results travel as ``torch.save`` bytes, not through torch's shared-memory queue
reductions: a rank exits as soon as it has reported, and shared-memory handles do not
outlive their sender. Ranks leave with ``os._exit`` after a clean
``destroy_process_group``, because gloo sometimes aborts at interpreter exit
("terminate called without an active exception") after all work is done; a run is
judged by its results, never by that exit.

Ranks are forked from a ``forkserver`` that has imported torch once, where the
platform has one (Linux, macOS), instead of ``spawn`` 's fresh interpreter per rank:
``import torch`` takes 1.5 to 5 s on a 2-core machine, and the demo, every benchmark
and most tests start ranks many times (measured: 0.18 s per start against 2.9 s). A
forked rank still starts from a clean interpreter state as far as overlapkit goes: the
server imports only torch, and each rank gets the caller's current environment,
working directory and ``sys.path``, as with ``spawn`` (:data:`PRELOADED` lists what
the server imports). Its peak RSS (``VmHWM``) starts
from what it maps itself, not from the caller's (measured: 149 MiB after the fork,
against 218 MiB for a spawned rank that imports torch).
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue as queue_module
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.errors import OverlapkitError

__all__ = ["PRELOADED", "RankFailedError", "RankTimeoutError", "free_port", "run_distributed"]


class RankFailedError(OverlapkitError, RuntimeError):
    """A rank raised; the message holds its traceback."""


class RankTimeoutError(OverlapkitError, TimeoutError):
    """Some ranks did not report within the timeout and were killed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _exit_when_orphaned() -> None:
    """Exit this rank once the process that started it is gone (killed with SIGKILL or
    SIGTERM, which skip its clean-up): an orphaned rank would otherwise wait in a
    collective until gloo's timeout. The caller is watched through multiprocessing's
    parent sentinel, not ``getppid()``: a forkserver's rank has the server as parent."""
    parent = mp.parent_process()
    if parent is not None:
        parent.join()
    os._exit(1)


#: what the forkserver imports once for every rank: torch and the parts of it that
#: overlapkit's built-in plugins import (``torch.distributed.checkpoint`` alone takes
#: 0.5 s), none of overlapkit itself; and ``torch._dynamo``, which the first
#: ``torch.optim`` optimizer a process builds imports (``Optimizer.__init__``): 1.6 s of
#: CPU per rank on a loaded 2-core machine, 0.1 s with it preloaded (measured on torch
#: 2.13, 2 ranks building one AdamW: 9.9 s per run against 1.0 s; docs/benchmarks.md)
PRELOADED = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.algorithms.ddp_comm_hooks",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch._dynamo",
)


def _context() -> Any:
    """A multiprocessing context whose processes start with torch already imported:
    ``forkserver`` with torch preloaded, or ``spawn`` where there is no forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))
    return ctx


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: Sequence[Any],
    env: Mapping[str, str],
    timeout: float,
    results: Any,
    backend: str = "gloo",
) -> None:
    threading.Thread(target=_exit_when_orphaned, daemon=True).start()
    os.environ.clear()  # the caller's environment now, not the forkserver's at its start
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    status, payload = "ok", b""
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per local rank
        dist.init_process_group(
            backend, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        payload = _dumps(fn(rank, world_size, *args))
    except BaseException:
        status, payload = "error", traceback.format_exc().encode()
    results.put((rank, status, payload))
    results.close()
    results.join_thread()
    if status == "ok" and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # the results are already reported
            pass
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo ranks (or NCCL
    ranks, one GPU each: ``backend="nccl"``, rank ``r`` on ``cuda:r``).

    ``fn`` must be importable by name (a module-level function), since ranks are
    started from a fresh interpreter (a forkserver's, with torch imported, or
    ``spawn``). Each rank uses one intra-op thread. The ranks
    meet on ``port`` of 127.0.0.1 (a free one when not given).

    :return: the return values, indexed by rank.
    :raises RankFailedError: a rank raised (its traceback is in the message).
    :raises RankTimeoutError: not every rank reported within ``timeout`` seconds.

    A free port taken by another process between choosing it and rank 0 listening on
    it (``EADDRINUSE`` as the ranks meet, before ``fn`` runs anywhere: seen with test
    environments running side by side) is chosen again, twice at most.
    """
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout, env,
                             free_port() if port is None else port, backend)
        except RankFailedError as error:
            if port is not None or attempt == 2 or not _port_taken(str(error)):
                raise
    raise AssertionError("unreachable")


def _port_taken(message: str) -> bool:
    """A rank failed because the chosen port was taken as the ranks met."""
    return "EADDRINUSE" in message and "init_process_group" in message


def _run_once(fn: Callable[..., Any], world_size: int, args: Sequence[Any],
              timeout: float, env: Mapping[str, str] | None, port: int,
              backend: str) -> list[Any]:
    """:func:`run_distributed` on ``port``, once."""
    ctx = _context()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, tuple(args), {**os.environ, **(env or {})},
                  timeout, results, backend),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    reported: dict[int, tuple[str, bytes]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(reported) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in reported
                        and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)  # let a last report arrive
                    while not results.empty():
                        rank, status, payload = results.get()
                        reported[rank] = (status, payload)
                    dead = [r for r in dead if r not in reported]
                if dead:
                    break
                continue
            reported[rank] = (status, payload)
            if status == "error":
                break
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(reported) == world_size else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = {r: p.decode() for r, (s, p) in reported.items() if s == "error"}
    if errors:
        rank = min(errors)
        raise RankFailedError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    missing = [r for r in range(world_size) if r not in reported]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise RankTimeoutError(
            f"ranks {missing} of {world_size} did not report within {timeout:.0f}s "
            f"(exit codes {codes}); they were stopped. Look for a hang in a collective "
            "or a crash in their output above."
        )
    return [_loads(reported[r][1]) for r in range(world_size)]
