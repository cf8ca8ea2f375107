"""Collectives that may be a program's last: their tensors go on the calling thread.

torch 2.13's gloo process group runs each collective on a worker thread of its own.
The thread marks the collective complete, which wakes the caller, and only then drops
its references to the collective's tensors. When a tensor made by Python code loses
its last reference there, the thread must take the GIL to free the Python object. If
the interpreter is already exiting by then, CPython ends the thread with
``pthread_exit``, its unwinding reaches a ``noexcept`` destructor, and the process
aborts: "terminate called without an active exception" (SIGABRT) after all its work
is done. torchrun then reports the job as failed. Over several nodes, the other
agents wait out torchrun's exit barrier (5 minutes) first.

This was measured, not guessed: core dumps of the README's training script under
torchrun show the abort in ``~AsyncBroadcastWork`` on a gloo worker thread. The
broadcast is the last one of ``checkpoint.save``. The interpreter's main thread was in
``Py_FinalizeEx`` at that moment. Plain PyTorch does the same: a DDP script that ends
with ``dist.barrier()`` aborted so in 7 of 20 runs on 2 loaded cores.

Here, a collective keeps its tensors until the worker thread has let go of them
(:func:`wait_until_released`), so the last reference goes on the calling thread. Used
for the collectives that end overlapkit's calls a program may end with:
:func:`broadcast_text` (the outcome of rank 0's work that ends ``checkpoint.save``) and
:func:`release_here` (post-local SGD's and DiLoCo's model averaging, the last
collective of a loop whose last step averages).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["RELEASE_SECONDS", "broadcast_text", "references", "release_here",
           "wait_until_released"]

#: how long :func:`wait_until_released` waits for the worker threads at most: they let
#: go within microseconds once scheduled; this bounds a thread starved on a busy host,
#: and what a save could lose if something else kept the tensors (a debug wrapper)
RELEASE_SECONDS = 1.0


def references(tensor: torch.Tensor) -> int:
    """How many references hold ``tensor``'s C++ object: its Python object's, and any
    C++ holder's (a collective's work, a view)."""
    return int(tensor._use_count())  # type: ignore[attr-defined]


def wait_until_released(tensors: Iterable[torch.Tensor], *,
                        seconds: float = RELEASE_SECONDS) -> bool:
    """Wait until nothing but the caller holds each of ``tensors``: the process group's
    worker threads have dropped the finished collective's references. Sleeps between
    checks (so a worker waiting for the GIL gets it). Returns ``False`` if ``seconds``
    passed first; the caller goes on either way."""
    pending = list(tensors)
    deadline = time.monotonic() + seconds
    pause = 1e-5
    while True:
        # one reference is the caller's own Python object; the rest are C++ holders
        pending = [tensor for tensor in pending if references(tensor) > 1]
        if not pending:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def release_here(tensors: Iterable[torch.Tensor]) -> None:
    """:func:`wait_until_released` for the CPU tensors among ``tensors``, those of gloo's
    collectives. An accelerator's are left alone: NCCL's watchdog holds a finished
    work for a while, and waiting for it would stall the step."""
    wait_until_released([tensor for tensor in tensors if tensor.device.type == "cpu"])


def broadcast_text(text: str | None, src: int = 0, group: Any = None) -> str | None:
    """``text`` of rank ``src`` on every rank of ``group`` (``None`` included), as
    ``dist.broadcast_object_list([text], src)`` gives it: on the device it would use
    (the current GPU for NCCL), with no unpickling, and gloo's tensors released on this
    thread (:func:`release_here`)."""
    import torch.distributed as dist

    # the device broadcast_object_list picks for the group ("cpu" for gloo, "cuda" for
    # NCCL): a private helper of torch's, stable since 2.0
    device = torch.device(dist.distributed_c10d._get_object_coll_device(group))
    data = b"" if text is None else text.encode("utf-8")
    size = torch.tensor([-1 if text is None else len(data)], dtype=torch.int64,
                        device=device)
    dist.broadcast(size, src=src, group=group)
    release_here([size])
    length = int(size.item())
    if length <= 0:
        return None if length < 0 else ""
    payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
               if dist.get_rank() == src else
               torch.empty(length, dtype=torch.uint8, device=device))
    dist.broadcast(payload, src=src, group=group)
    release_here([payload])
    return bytes(payload.tolist()).decode("utf-8")
