"""The rank side of tests/test_sharded_peer_failure.py, run as a script, one process per
rank (a rank killed mid-backward must not take the test's launcher with it):

    python sharded_peer_failure_ranks.py RANK WORLD PORT TECHNIQUE FAILURE TIMEOUT DIR

Two good steps of ``overlap_ddp`` (``TECHNIQUE``: ``sharded``, ``unsharded``, ``comm``:
``step_thread="comm"``, or ``clipped``: sharded with ``clip_grad_norm``, whose steps wait
for the end of backward) on a DDP model whose process group has a ``TIMEOUT``-second
timeout, then, in the third backward, rank 1 fails (``FAILURE``):

- ``raises``: raises mid-backward, goes on, and stays alive (the issue's probe);
- ``stalls``: sleeps mid-backward for twice the timeout, then goes on with its backward;
- ``killed``: kills itself (SIGKILL) mid-backward;
- ``skips_step``: (sharded) after a backward inside ``no_sync()`` on both ranks, raises
  instead of calling ``step()``: rank 0's full step waits for rank 1's share in the
  parameter exchange alone.

Each rank writes what it saw to ``DIR/rank{R}.json`` (rank 1 not when killed): the
error's type, message, ``silent`` / ``lost`` ranks, and how long the failing backward
took; on rank 0 (sharded) also what the next forward and ``step()`` raised. Each rank
stays until the others have written their results: rank 0 keeps the store, and rank 1
stays alive.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from overlapkit.nodes.failed_collective import group_timeout


def _seen(error: BaseException, started: float) -> dict[str, Any]:
    return {"type": type(error).__name__, "module": type(error).__module__,
            "message": str(error), "seconds": time.monotonic() - started,
            "silent": getattr(error, "silent", None), "lost": getattr(error, "lost", None)}


def main(rank: int, world_size: int, port: int, technique: str, failure: str,
         timeout: float, directory: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # the default group waits long (the ranks start at different times); the model's
    # group has the short timeout under test, and the exchange takes it
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout))
    import overlapkit

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.001)  # one bucket per layer
    sharded = technique in ("sharded", "clipped")
    options = {"sharded": {}, "unsharded": {}, "comm": {"step_thread": "comm"},
               "clipped": {"clip_grad_norm": 1.0}}[technique]  # the last: a global step
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=0.01,
                                 shard_optimizer_state=sharded, **options)
    armed = [False]

    def fail(module: Any, grad_input: Any, grad_output: Any) -> None:
        if not armed[0]:
            return
        armed[0] = False
        if failure == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if failure == "stalls":
            time.sleep(2 * timeout)
            return
        raise RuntimeError("rank 1 fails mid-backward")

    if rank == 1:  # mid-backward: the buckets of the last three layers are reduced
        ddp.module[2].register_full_backward_hook(fail)
    result: dict[str, Any] = {"error": None, "next forward": None, "next step": None}
    generator = torch.Generator().manual_seed(rank)
    for step in range(3):
        x = torch.randn(8, 32, generator=generator)
        armed[0] = step == 2
        started = time.monotonic()
        try:
            if step == 2 and failure == "skips_step":
                with ddp.no_sync():
                    ddp(x).square().mean().backward()
                if rank == 1:
                    raise RuntimeError("rank 1 fails before step()")
            else:
                ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        except Exception as error:
            result["error"] = _seen(error, started)
            break
    if sharded:  # the exchange's group has the model's group's timeout
        exchange_timeout = group_timeout(opt._stepper.exchange.group)
        result["exchange timeout"] = exchange_timeout and exchange_timeout.total_seconds()
    if rank == 0 and sharded and result["error"] is not None:
        started = time.monotonic()
        try:  # the parameters are not the owners' any more: never silently used
            ddp(x)
        except Exception as error:
            result["next forward"] = _seen(error, started)
        started = time.monotonic()
        try:
            opt.step()
        except Exception as error:
            result["next step"] = _seen(error, started)
    (directory / f"rank{rank}.tmp").write_text(json.dumps(result))
    (directory / f"rank{rank}.tmp").rename(directory / f"rank{rank}.json")
    # rank 0 keeps the store for the others' roll call; rank 1 stays alive (and
    # beating) until the others have seen the failure
    others = [directory / f"rank{other}.json" for other in range(world_size)
              if not (failure == "killed" and other == 1)]
    deadline = time.monotonic() + 6 * timeout + 30
    while not all(map(Path.exists, others)) and time.monotonic() < deadline:
        time.sleep(0.1)
    os._exit(0)  # gloo may abort at exit with a broken group; the result is written


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5],
         float(sys.argv[6]), Path(sys.argv[7]))
