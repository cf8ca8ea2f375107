"""Collectives that may be a program's last: gloo's threads never need the GIL for them.

torch 2.13's gloo process group runs each collective on a worker thread of its own.
The thread marks the collective complete, which wakes the caller, and only then drops
its references to the collective's tensors. In torch 2.13 a tensor's C++ object keeps
a reference to its Python object while anything but that Python object holds it
(``c10/util/intrusive_ptr.h``, "PyObject preservation"): the holder whose drop leaves
the Python object alone must take the GIL to let go of it. When that holder is a gloo
thread and the interpreter is already exiting, CPython ends the thread with
``pthread_exit``, its unwinding reaches a ``noexcept`` destructor, and the process
aborts: "terminate called without an active exception" (SIGABRT) after all its work
is done. torchrun then reports the job as failed. Over several nodes, the other
agents wait out torchrun's exit barrier (5 minutes) first.

This was measured, not guessed: core dumps of the README's training script under
torchrun show the abort in ``~AsyncBroadcastWork`` on a gloo worker thread. The
broadcast is the last one of ``checkpoint.save``. The interpreter's main thread was in
``Py_FinalizeEx`` at that moment. Plain PyTorch does the same: a DDP script that ends
with ``dist.barrier()`` aborted so in 5 and 7 of 20 runs (two sessions) on 2 loaded cores.

Here, a :class:`Hold` takes a C++ reference of its own to each CPU tensor *before* the
collective starts, and gives it up on the calling thread once the worker has let go.
The worker's drop is then never the one that leaves the Python object alone, so it
never needs the GIL, however late it runs. Waiting for the worker is bounded
(:data:`RELEASE_SECONDS`); a worker starved past it (a busy host) leaves its hold
parked, given up on a later call or at the interpreter's exit (an ``atexit`` handler,
while the worker can still run), and kept for good if the worker still has not let go
then. Where the last drop goes is never left to timing.

Used for the collectives that end overlapkit's calls a program may end with:
:func:`broadcast_text` (the outcome of rank 0's work that ends ``checkpoint.save``),
:func:`gather_object` (the sharded optimizer's ``consolidate_state_dict()``, which a
ZeRO script ends with before rank 0 saves) and post-local SGD's and DiLoCo's model
averaging (the last collective of a loop whose last step averages).
"""

from __future__ import annotations

import atexit
import ctypes
import io
import pickle
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["EXIT_SECONDS", "RELEASE_SECONDS", "DestinationsDifferError", "Hold", "TagsDifferError",
           "broadcast_text", "gather_object",
           "parked", "references", "release_parked", "wait_until_released"]

#: how long :meth:`Hold.release` waits for the worker threads before parking the hold:
#: they let go within microseconds once scheduled
RELEASE_SECONDS = 1.0

#: how long the interpreter's exit waits for the workers of parked holds
EXIT_SECONDS = 10.0


def references(tensor: torch.Tensor) -> int:
    """How many references hold ``tensor``'s C++ object: its Python object's, and any
    C++ holder's (a collective's work, a view)."""
    return int(tensor._use_count())  # type: ignore[attr-defined]


def wait_until_released(tensors: Iterable[torch.Tensor | tuple[torch.Tensor, int]], *,
                        seconds: float = RELEASE_SECONDS) -> bool:
    """Wait until no more than the caller holds each of ``tensors``: the process
    group's worker threads have dropped the finished collective's references. An entry
    ``(tensor, n)`` waits for ``n`` references at most (the caller's own holders), a
    plain tensor for 1. Sleeps between checks. Returns ``False`` if ``seconds`` passed
    first."""
    pending = [entry if isinstance(entry, tuple) else (entry, 1) for entry in tensors]
    deadline = time.monotonic() + seconds
    pause = 1e-5
    while True:
        pending = [(tensor, most) for tensor, most in pending if references(tensor) > most]
        if not pending:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class Hold:
    """A C++ reference to each tensor gloo will run a collective on, taken before it
    starts, so that the worker thread's drop never leaves a tensor's Python object
    alone.

    Take it before the collective and call :meth:`release` once the collective is
    complete; or, for a blocking collective, ``with Hold(tensors, group):
    dist.broadcast(...)`` (released as the block ends, unless it raised). Tensors
    another backend runs (NCCL's, where ``group`` maps their device to it) are not
    held: NCCL's watchdog keeps a finished work for a while, and waiting for it would
    stall the step.

    A view holds its base only, so a tensor that is itself a view, or an inference
    tensor (whose views keep no base), cannot be held: that is a ``TypeError``, not a
    silent return to waiting, which can lose the race. overlapkit's collectives give
    gloo tensors of their own, made outside inference mode.
    """

    def __init__(self, tensors: Iterable[torch.Tensor], group: Any = None) -> None:
        unique = {id(tensor): tensor for tensor in tensors if _run_by_gloo(tensor, group)}
        self._views: list[torch.Tensor] = []
        for tensor in unique.values():
            view = tensor.view(tensor.shape)  # a view keeps a C++ reference to its base
            if view._base is not tensor:
                raise TypeError(
                    "exit_safe.Hold cannot hold a tensor that is a view or an inference "
                    "tensor: give the collective a tensor of its own, made outside "
                    "torch.inference_mode (torch.cat, torch.empty, .clone())")
            self._views.append(view)
        #: (tensor, the references it keeps once the worker let go): those it has now,
        #: the hold's included (a tensor that requires grad has more than one per view)
        self._watched = [(tensor, references(tensor)) for tensor in unique.values()]

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, error_type: type[BaseException] | None, *_: object) -> None:
        if error_type is None:  # a collective that raised: nothing to wait for
            self.release()

    def release(self) -> None:
        """Give the hold up on this thread once the workers let go (the collective must
        be complete); parks it if they have not within :data:`RELEASE_SECONDS`."""
        release_parked(seconds=0.0)
        watched, views = self._watched, self._views
        self._watched, self._views = [], []
        if not wait_until_released(watched, seconds=RELEASE_SECONDS):
            with _parked_lock:
                _parked.append((watched, views))


def _run_by_gloo(tensor: torch.Tensor, group: Any) -> bool:
    """Whether gloo runs ``group``'s collectives on ``tensor`` (its device's backend);
    with no process group, whether it is a CPU tensor."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return tensor.device.type == "cpu"
    process_group = group if group is not None else dist.group.WORLD
    if process_group is None:
        return tensor.device.type == "cpu"
    try:
        backend = process_group._get_backend(tensor.device)
    except RuntimeError:  # no backend for this device: no collective either
        return False
    return isinstance(backend, dist.ProcessGroupGloo)


#: holds whose workers had not let go when :meth:`Hold.release` stopped waiting
_parked: list[tuple[list[tuple[torch.Tensor, int]], list[torch.Tensor]]] = []
_parked_lock = threading.Lock()


def _let_go(hold: tuple[list[tuple[torch.Tensor, int]], list[torch.Tensor]]) -> bool:
    return all(references(tensor) <= most for tensor, most in hold[0])


def parked() -> int:
    """How many parked holds still wait for a worker thread."""
    with _parked_lock:
        return sum(not _let_go(hold) for hold in _parked)


def release_parked(*, seconds: float = EXIT_SECONDS) -> bool:
    """Wait up to ``seconds`` for the workers of parked holds, then give up here the
    holds they let go of. Returns whether none is left parked."""
    with _parked_lock:
        waiting = [entry for hold in _parked for entry in hold[0]]
    if not waiting:
        return True
    wait_until_released(waiting, seconds=seconds)
    with _parked_lock:
        let_go = [_let_go(hold) for hold in _parked]
        done = [hold for hold, free in zip(_parked, let_go, strict=True) if free]
        _parked[:] = [hold for hold, free in zip(_parked, let_go, strict=True) if not free]
        left = len(_parked)
    del done, waiting  # the last references, on this thread
    return left == 0


@atexit.register
def _release_parked_at_exit() -> None:
    """At exit, while a worker can still run: give the parked holds up here. A hold
    whose worker has not let go after :data:`EXIT_SECONDS` is kept for good (its
    views' Python objects are leaked), so that worker's late drop still never needs
    the GIL."""
    if release_parked():
        return
    with _parked_lock:
        for _, views in _parked:
            for view in views:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(view))


def broadcast_text(text: str | None, src: int = 0, group: Any = None) -> str | None:
    """``text`` of rank ``src`` on every rank of ``group`` (``None`` included), as
    ``dist.broadcast_object_list([text], src)`` gives it: on the device it would use
    (the current GPU for NCCL), with no unpickling, and gloo's threads kept from the
    GIL (:class:`Hold`)."""
    import torch.distributed as dist

    # the device broadcast_object_list picks for the group ("cpu" for gloo, "cuda" for
    # NCCL): a private helper of torch's, stable since 2.0
    device = torch.device(dist.distributed_c10d._get_object_coll_device(group))
    with torch.inference_mode(False):  # a tensor made in inference mode cannot be held
        return _broadcast_text(text, src, group, device)


def _broadcast_text(text: str | None, src: int, group: Any, device: torch.device
                    ) -> str | None:
    import torch.distributed as dist

    data = b"" if text is None else text.encode("utf-8")
    size = torch.tensor([-1 if text is None else len(data)], dtype=torch.int64,
                        device=device)
    with Hold([size], group):
        dist.broadcast(size, src=src, group=group)
    length = int(size.item())
    if length <= 0:
        return None if length < 0 else ""
    payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
               if dist.get_rank() == src else
               torch.empty(length, dtype=torch.uint8, device=device))
    with Hold([payload], group):
        dist.broadcast(payload, src=src, group=group)
    return bytes(payload.tolist()).decode("utf-8")


class DestinationsDifferError(ValueError):
    """:func:`gather_object` called with different ``dst`` on different ranks, raised on
    every rank before anything is gathered. ``destinations``: each rank's ``dst`` (a
    global rank), in group order."""

    def __init__(self, destinations: list[int]) -> None:
        super().__init__(f"gather_object(dst=...) got different destinations on the "
                         f"ranks of the group: {destinations} (global ranks, in group "
                         "order)")
        self.destinations = destinations


class TagsDifferError(ValueError):
    """:func:`gather_object` called with different ``tag`` on different ranks (each
    rank gathering something else), raised on every rank before anything is gathered.
    ``tags``: each rank's, in group order."""

    def __init__(self, tags: list[int]) -> None:
        super().__init__(f"gather_object(tag=...) got different tags on the ranks of the "
                         f"group: {tags} (in group order)")
        self.tags = tags


def gather_object(obj: Any, dst: int = 0, group: Any = None, *, tag: int = 0
                  ) -> list[Any] | None:
    """Every rank's ``obj`` of ``group``, in group order, on global rank ``dst``; None
    elsewhere. What ``dist.gather_object(obj, gathered, dst, group)`` leaves in
    ``gathered``: the same pickling, on the device it would use, with gloo's threads
    kept from the GIL (:class:`Hold`; torch's own gives gloo views, which cannot be
    held).

    :raises DestinationsDifferError: on every rank, the ranks named different ``dst``
        (learnt from the sizes every rank sends first: torch's own waited until the
        group's timeout, each rank for the gather it named).
    :raises TagsDifferError: on every rank, the ranks gave different ``tag`` (an
        integer naming what is gathered, sent with the sizes): torch's own paired
        whatever the ranks sent.
    """
    import torch.distributed as dist

    if dist._rank_not_in_group(group):
        return None  # as torch's: nothing to take part in
    device = torch.device(dist.distributed_c10d._get_object_coll_device(group))
    buffer = io.BytesIO()
    pickle.Pickler(buffer).dump(obj)
    with torch.inference_mode(False):  # a tensor made in inference mode cannot be held
        return _gather_bytes(buffer.getvalue(), dst, group, device, tag)


def _gather_bytes(data: bytes, dst: int, group: Any, device: torch.device, tag: int
                  ) -> list[Any] | None:
    import torch.distributed as dist

    ranks = dist.get_world_size(group)
    size = torch.tensor([len(data), dst, tag], dtype=torch.int64, device=device)
    sizes = [torch.zeros(3, dtype=torch.int64, device=device) for _ in range(ranks)]
    with Hold([size, *sizes], group):
        dist.all_gather(sizes, size, group=group)
    lengths = [int(each[0].item()) for each in sizes]
    destinations = [int(each[1].item()) for each in sizes]
    if len(set(destinations)) > 1:  # gloo would pair the gathers wrongly, or hang
        raise DestinationsDifferError(destinations)
    tags = [int(each[2].item()) for each in sizes]
    if len(set(tags)) > 1:  # each rank gathering something else
        raise TagsDifferError(tags)
    payload = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    if data:
        payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = ([torch.empty(max(lengths), dtype=torch.uint8, device=device)
                 for _ in range(ranks)] if dist.get_rank() == dst else None)
    with Hold([payload, *(gathered or [])], group):
        dist.gather(payload, gathered, dst=dst, group=group)
    if gathered is None:
        return None
    return [pickle.Unpickler(io.BytesIO(each[:length].cpu().numpy().tobytes())).load()
            for each, length in zip(gathered, lengths, strict=True)]
