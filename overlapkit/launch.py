"""Run a function on every rank, locally spawned or under torchrun.

The command-line jobs (``overlapkit demo``, ``overlapkit bench``) work the same in two
settings:

- **locally**, with no launcher: :func:`launch` spawns ``world_size`` gloo ranks on
  this machine (:func:`overlapkit.distributed.run_distributed`) and returns every
  rank's result;
- **under torchrun** (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment, one
  node or many): this process *is* one rank; :func:`launch` joins torchrun's
  rendezvous, runs the function here, and gathers every rank's result on rank 0 (other
  ranks get ``None``).

The checks (:func:`under_torchrun`, :func:`check_world_size`, :func:`check_port_free`)
import no torch, so the command line validates its arguments before paying for it.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

from overlapkit.errors import ConfigurationError

__all__ = [
    "check_port_free", "check_world_size", "exit_torchrun_rank", "launch",
    "max_local_world_size", "under_torchrun",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """Whether a launcher (torchrun) started this process as one rank of a job."""
    return all(var in os.environ for var in _TORCHRUN_VARS)


def max_local_world_size() -> int:
    """How many CPU ranks this machine runs usefully: four per core.

    gloo ranks beyond that spend their time waiting for a core and in collectives;
    with many more, start-up alone outlasts the default timeouts.
    """
    return 4 * (os.cpu_count() or 1)


def check_port_free(port: int) -> None:
    """Raise a ConfigurationError unless ``port`` can be bound on 127.0.0.1."""
    if not 0 < port < 65536:
        raise ConfigurationError(f"port {port} is not a TCP port; pass one from 1 to 65535.")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise ConfigurationError(
                f"port {port} is in use on this machine ({exc.strerror}); pass another "
                "--port, or leave it out to pick a free one."
            ) from None


def check_world_size(world_size: int) -> None:
    """Raise a ConfigurationError unless this machine can run ``world_size`` local ranks."""
    limit = max_local_world_size()
    if world_size < 1:
        raise ConfigurationError(f"world size must be at least 1, got {world_size}.")
    if world_size > limit:
        raise ConfigurationError(
            f"world size {world_size} is more than this machine runs usefully "
            f"({os.cpu_count()} cores: at most {limit} local ranks); pass a smaller "
            "--world-size, or launch on several nodes with torchrun."
        )


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 600.0,
    port: int | None = None,
) -> list[Any] | None:
    """Run ``fn(rank, world_size, *args)`` on every rank and collect the results.

    Locally, spawns ``world_size`` ranks (on ``port`` when given) and returns every
    rank's result. Under torchrun, ``world_size`` and ``port`` are torchrun's; returns
    the list of results on rank 0 and ``None`` on the other ranks.
    """
    if under_torchrun():
        return _launch_here(fn, args, timeout)
    from overlapkit.distributed import run_distributed  # imports torch: not at start-up

    check_world_size(world_size)
    if port is not None:
        check_port_free(port)
    return run_distributed(fn, world_size, args=args, timeout=timeout, port=port)


def _launch_here(fn: Callable[..., Any], args: Sequence[Any], timeout: float) -> list[Any] | None:
    import torch
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        # One process group for the whole command: torchrun's store keeps the keys of
        # a destroyed group, and a second init_process_group on it fails to connect.
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        atexit.register(_leave_group)
        _JOINED.append(True)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(
            os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    from overlapkit.nodes.lost_ranks import lost_ranks_named

    with lost_ranks_named("running a command's work on torchrun's ranks"):
        result = fn(rank, world_size, *args)
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        dist.barrier()
    return gathered


#: not empty once this process joined torchrun's group in :func:`_launch_here`
_JOINED: list[bool] = []


def exit_torchrun_rank(status: int) -> None:
    """End a torchrun rank that joined the group: leave it cleanly, flush the output
    and ``os._exit(status)``, as :func:`overlapkit.distributed.run_distributed`'s
    ranks do. gloo sometimes aborts a process at interpreter exit after all its work
    ("terminate called without an active exception"; measured: ``torchrun ... -m
    overlapkit demo`` failed so once in a full test run), and torchrun then reports the
    whole job as failed. Does nothing in a process that joined no group."""
    if not _JOINED:
        return
    _leave_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _leave_group() -> None:
    """Leave the process group cleanly at exit (gloo may abort at interpreter exit
    otherwise)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
