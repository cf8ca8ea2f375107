"""A collective that may be a program's last leaves nothing for gloo's worker threads to
free at interpreter exit (overlapkit.nodes.exit_safe).

The abort it prevents ("terminate called without an active exception" after the work
is done) needs a worker thread to lose a race with the interpreter's exit, so it is
measured in runs of the README script (docs/nodes.rst). What is tested here is the
condition that rules it out, on every call: when ``checkpoint.save``'s last collective
returns, every tensor it gave gloo is already freed, on the calling thread. The caller
keeps the GIL meanwhile (a long switch interval), as an exiting interpreter does, so a
worker thread that still held one could not free it either.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from overlapkit.checkpoint.directories import on_rank_zero
from overlapkit.distributed import run_distributed
from overlapkit.errors import CheckpointError
from overlapkit.nodes.exit_safe import broadcast_text, references, wait_until_released


def test_waiting_ends_once_the_other_holder_lets_go() -> None:
    tensor = torch.zeros(4)
    holder = [tensor.view(2, 2)]  # a second C++ reference to the tensor
    assert references(tensor) > 1
    threading.Timer(0.2, holder.clear).start()
    started = time.monotonic()
    assert wait_until_released([tensor])
    assert time.monotonic() - started >= 0.15 and references(tensor) == 1


def test_waiting_gives_up_after_its_time_and_says_so() -> None:
    tensor = torch.zeros(4)
    holder = tensor.view(2, 2)
    started = time.monotonic()
    assert not wait_until_released([tensor], seconds=0.1)
    assert 0.1 <= time.monotonic() - started < 5
    del holder


TEXTS = [None, "", "PermissionError: [Errno 13] Permission denied: 'résumé'", "x" * 100_000]


def broadcast_texts(rank: int, world_size: int) -> list[str | None]:
    # the other ranks pass texts of their own, of the same length too: rank 1's wins
    return [broadcast_text(text if rank == 1 else ("y" * len(text) if text else "other"),
                           src=1) for text in TEXTS]


def test_a_text_reaches_every_rank_as_the_source_sent_it() -> None:
    for received in run_distributed(broadcast_texts, 3):
        assert received == TEXTS


class CollectiveTensors(TorchDispatchMode):
    """Weak references to every tensor given to a c10d collective under this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            self.seen += [weakref.ref(tensor) for tensor in args[0]]
        return func(*args, **(kwargs or {}))


def tensors_left_after_rank_zeros_work(rank: int, world_size: int, calls: int
                                       ) -> list[int]:
    """How many of the collective's tensors were still alive when each call returned."""

    def fail() -> None:
        raise PermissionError("read-only file system")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)  # this thread keeps the GIL unless it waits
    left = []
    try:
        for call in range(calls):
            with CollectiveTensors() as mode:
                try:
                    on_rank_zero("testing", Path("/nowhere"),
                                 fail if call % 3 == 2 else (lambda: None))
                except CheckpointError:
                    assert call % 3 == 2
            left.append(sum(ref() is not None for ref in mode.seen))
            assert mode.seen
    finally:
        sys.setswitchinterval(interval)
    return left


def test_rank_zeros_outcome_leaves_no_tensor_for_glooss_threads_to_free() -> None:
    """(Before: ``dist.broadcast_object_list``'s tensors outlived 10 to 12 of 50 calls,
    held by a gloo worker thread waiting for the GIL.)"""
    for left in run_distributed(tensors_left_after_rank_zeros_work, 2, args=(30,)):
        assert left == [0] * 30, left


def tensors_left_after_averaging(rank: int, world_size: int, calls: int, async_op: bool
                                 ) -> list[int]:
    """How many tensors of each averaging's reduction were alive when it returned."""
    from overlapkit.local_sgd.averaging import PendingAverage

    params = [torch.nn.Parameter(torch.full((3, 4), float(rank))) for _ in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    left = []
    try:
        for _ in range(calls):
            with CollectiveTensors() as mode:
                PendingAverage(params, torch.distributed.group.WORLD, async_op=async_op).wait()
            left.append(sum(ref() is not None for ref in mode.seen[-1:]))
    finally:
        sys.setswitchinterval(interval)
    assert all(bool((p == 0.5).all()) for p in params)  # the mean of ranks 0 and 1
    return left


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "in flight"])
def test_the_model_averagings_reduction_leaves_no_tensor_for_glooss_threads(
    async_op: bool,
) -> None:
    """Post-local SGD's and DiLoCo's averaging is the last collective of a loop whose
    last step averages."""
    for left in run_distributed(tensors_left_after_averaging, 2, args=(30, async_op)):
        assert left == [0] * 30, left
