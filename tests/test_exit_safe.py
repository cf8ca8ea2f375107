"""A collective that may be a program's last leaves nothing for gloo's worker threads to
free at interpreter exit (overlapkit.nodes.exit_safe).

The abort it prevents ("terminate called without an active exception" after the work
is done) needs a worker thread to lose a race with the interpreter's exit, so it is
measured in runs of the README script (docs/nodes.rst). What is tested here is the
conditions that rule it out, on every call of ``checkpoint.save``'s last collective
and of a model averaging: each tensor gloo gets is already held by the caller (so a
worker's drop never leaves its Python object alone and never needs the GIL), and is
freed on the calling thread (each tensor's weak reference records the thread that
freed it). The caller keeps the GIL while it can (a long switch interval), as an
exiting interpreter does. A worker starved past the wait (CI's busy host once was) is
what parking covers, tested with a thread of the test's own that holds a tensor.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from overlapkit.checkpoint.directories import on_rank_zero
from overlapkit.distributed import run_distributed
from overlapkit.errors import CheckpointError
from overlapkit.nodes import exit_safe
from overlapkit.nodes.exit_safe import (
    Hold,
    broadcast_text,
    parked,
    references,
    release_parked,
    wait_until_released,
)


def test_waiting_ends_once_the_other_holder_lets_go() -> None:
    tensor = torch.zeros(4)
    holder = [tensor.view(2, 2)]  # a second C++ reference to the tensor
    assert references(tensor) > 1
    threading.Timer(0.2, holder.clear).start()
    started = time.monotonic()
    assert wait_until_released([tensor], seconds=30)
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


def test_waiting_for_more_than_one_reference_counts_the_callers_own() -> None:
    tensor = torch.zeros(4)
    mine = tensor.view(2, 2)
    assert wait_until_released([(tensor, 2)], seconds=0)
    assert not wait_until_released([tensor], seconds=0)
    del mine


class FreedOn:
    """Weak references that record the name of the thread each tensor was freed on."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[torch.Tensor]] = []
        self.threads: list[str] = []

    def watch(self, tensor: torch.Tensor) -> None:
        self.refs.append(weakref.ref(
            tensor, lambda _: self.threads.append(threading.current_thread().name)))

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.refs)


def test_a_hold_takes_one_reference_and_gives_it_up_here() -> None:
    freed = FreedOn()
    tensor = torch.zeros(4)
    freed.watch(tensor)
    hold = Hold([tensor])
    assert references(tensor) == 2
    hold.release()
    assert references(tensor) == 1 and parked() == 0
    del tensor
    assert freed.threads == ["MainThread"]


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(4, 2)[1],
    lambda: torch.inference_mode()(torch.zeros)(4),
], ids=["a view", "an inference tensor"])
def test_a_tensor_a_view_cannot_hold_is_refused_not_left_to_the_race(make: Any) -> None:
    tensor = make()
    with pytest.raises(TypeError, match="cannot hold a tensor that is a view or an "
                       "inference tensor: give the collective a tensor of its own"):
        Hold([tensor])


def test_a_tensor_given_twice_or_requiring_grad_is_held_once_and_given_up() -> None:
    """A view of a tensor that requires grad adds two references, not one."""
    plain, learned = torch.zeros(4), torch.zeros(4, requires_grad=True)
    hold = Hold([plain, learned, plain])
    assert references(plain) == 2 and references(learned) > 2
    started = time.monotonic()
    hold.release()
    assert time.monotonic() - started < 0.5 and parked() == 0
    assert references(plain) == 1 and references(learned) == 1


def test_a_tensor_another_thread_still_holds_is_parked_and_freed_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker starved past the wait: the hold stays, so the worker's late drop is not
    the one that leaves the Python object alone."""
    monkeypatch.setattr(exit_safe, "RELEASE_SECONDS", 0.05)
    freed = FreedOn()
    tensor = torch.zeros(4)
    freed.watch(tensor)
    hold = Hold([tensor])
    holder = [tensor.view(2, 2)]  # the "collective" of a worker that has not let go
    let_go = threading.Event()

    def worker() -> None:
        let_go.wait()
        holder.clear()

    thread = threading.Thread(target=worker, name="worker", daemon=True)
    thread.start()
    try:
        hold.release()
        assert parked() == 1
        del tensor, hold
    finally:
        let_go.set()
    thread.join()
    assert freed.alive() == 1 and freed.threads == []  # still held: parked
    assert parked() == 0  # the worker let go
    assert release_parked(seconds=5)
    assert freed.threads == ["MainThread"]


def test_a_hold_still_parked_at_exit_is_given_up_on_the_main_thread(tmp_path: Path) -> None:
    """The interpreter's exit waits for a parked hold's worker, then frees it."""
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent("""
        import threading, time, weakref
        import torch
        from overlapkit.nodes import exit_safe

        exit_safe.RELEASE_SECONDS = 0.01
        tensor = torch.zeros(4)
        done = weakref.ref(tensor, lambda _: print(
            "freed on", threading.current_thread().name, flush=True))
        hold = exit_safe.Hold([tensor])
        holder = [tensor.view(2, 2)]

        def worker():
            time.sleep(0.5)
            holder.clear()

        threading.Thread(target=worker, daemon=True).start()
        hold.release()
        print("parked", exit_safe.parked(), flush=True)
        del tensor, hold
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["parked 1", "freed on MainThread"], run.stdout


class CollectiveTensors(TorchDispatchMode):
    """For each tensor given to a c10d collective under this mode: how many references
    held it as the collective started, and the thread that freed it."""

    def __init__(self, freed: FreedOn) -> None:
        super().__init__()
        self.freed = freed
        self.references: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func.namespace == "c10d":  # inputs and outputs: (nested) lists of tensors
            for tensor in tree_leaves(args):
                if not isinstance(tensor, torch.Tensor):
                    continue
                self.freed.watch(tensor)
                self.references.append(references(tensor))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def keeping_the_gil() -> Iterator[None]:
    """This thread keeps the GIL unless it waits, as an exiting interpreter does."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def unheld_references() -> int:
    """The references a collective's tensor has as it starts when nothing holds it
    (the dispatcher's own: 3 in torch 2.13)."""
    mode = CollectiveTensors(FreedOn())
    with mode:
        torch.distributed.broadcast(torch.zeros(1), src=0)
    return mode.references[0]


def gloos_threads_and_the_gil(freed: FreedOn, started_with: list[int]) -> dict[str, Any]:
    """What the test asserts, once every parked hold is given up (parking itself is
    allowed: a busy host): tensors not held as their collective started, and the
    threads other than this one that freed one."""
    assert release_parked(seconds=60)
    assert freed.refs and freed.alive() == 0
    assert len(freed.threads) == len(freed.refs)
    this = threading.current_thread().name
    unheld = unheld_references()
    return {"not held": sum(n <= unheld for n in started_with),
            "freed elsewhere": [name for name in freed.threads if name != this]}


def rank_zeros_work(rank: int, world_size: int, calls: int) -> dict[str, Any]:
    def fail() -> None:
        raise PermissionError("read-only file system")

    freed = FreedOn()
    mode = CollectiveTensors(freed)
    with keeping_the_gil():
        for call in range(calls):
            with mode:
                try:
                    on_rank_zero("testing", Path("/nowhere"),
                                 fail if call % 3 == 2 else (lambda: None))
                except CheckpointError:
                    assert call % 3 == 2
    return gloos_threads_and_the_gil(freed, mode.references)


NONE_FOR_GLOO = {"not held": 0, "freed elsewhere": []}


def test_rank_zeros_outcome_leaves_gloos_threads_nothing_that_needs_the_gil() -> None:
    """(Before: ``dist.broadcast_object_list``'s tensors were freed by a gloo worker
    thread in 10 to 12 of 50 calls, after it waited for the GIL.)"""
    for seen in run_distributed(rank_zeros_work, 2, args=(30,)):
        assert seen == NONE_FOR_GLOO, seen


def averagings(rank: int, world_size: int, calls: int, async_op: bool) -> dict[str, Any]:
    from overlapkit.local_sgd.averaging import PendingAverage

    params = [torch.nn.Parameter(torch.full((3, 4), float(rank))) for _ in range(2)]
    freed = FreedOn()
    mode = CollectiveTensors(freed)
    with keeping_the_gil():
        for _ in range(calls):
            with mode:
                PendingAverage(params, torch.distributed.group.WORLD, async_op=async_op).wait()
    assert all(bool((p == 0.5).all()) for p in params)  # the mean of ranks 0 and 1
    return gloos_threads_and_the_gil(freed, mode.references)


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "in flight"])
def test_the_model_averagings_reduction_leaves_gloos_threads_nothing_that_needs_the_gil(
    async_op: bool,
) -> None:
    """Post-local SGD's and DiLoCo's averaging is the last collective of a loop whose
    last step averages."""
    for seen in run_distributed(averagings, 2, args=(30, async_op)):
        assert seen == NONE_FOR_GLOO, seen


OBJECTS = [{"step": torch.tensor(3.0), "exp_avg": torch.arange(5.0)}, None, "",
           "x" * 70_000, {1: [2, (3, "résumé")]}]


def gathered_both_ways(rank: int, world_size: int) -> list[Any]:
    """overlapkit's gather_object and torch's, of a different object on each rank: over
    the world on rank 1, and over the subgroup of ranks 4, 0 and 2 on rank 2."""
    from overlapkit.nodes.exit_safe import gather_object

    results: list[Any] = []
    sub = torch.distributed.new_group([4, 0, 2])
    for group, dst in ((None, 1), (sub, 2)):
        obj = OBJECTS[rank]
        ours = gather_object(obj, dst=dst, group=group)
        size = torch.distributed.get_world_size(group)
        theirs: list[Any] | None = [None] * size if rank == dst else None
        if not torch.distributed._rank_not_in_group(group):
            torch.distributed.gather_object(obj, theirs, dst=dst, group=group)
        results.append([ours, theirs])
    return results


def test_gather_object_gives_what_torchs_gives() -> None:
    """In group order, on the destination (a global rank) only; a rank outside the
    group takes no part."""
    results = run_distributed(gathered_both_ways, 5)
    for rank, (world, sub) in enumerate(results):
        for (ours, theirs), dst, expected in ((world, 1, OBJECTS),
                                              (sub, 2, [OBJECTS[i] for i in (0, 2, 4)])):
            if rank != dst:
                assert ours is None and theirs is None
                continue
            assert repr(ours) == repr(theirs) == repr(expected)
        if rank == 1:
            assert torch.equal(world[0][0]["exp_avg"], OBJECTS[0]["exp_avg"])


def consolidations(rank: int, world_size: int, calls: int) -> dict[str, Any]:
    """What a ZeRO script ends with: ``consolidate_state_dict(0)``, rank 0 saves."""
    import overlapkit

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=0.01,
                                 shard_optimizer_state=True)
    freed = FreedOn()
    mode = CollectiveTensors(freed)
    with keeping_the_gil():
        for _ in range(calls):
            ddp(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            with mode:
                opt.consolidate_state_dict(0)
            if rank == 0:
                assert len(opt.state_dict()["state"]) == 4
    return gloos_threads_and_the_gil(freed, mode.references)


def test_consolidating_the_sharded_state_leaves_gloos_threads_nothing_that_needs_the_gil(
) -> None:
    """(Before: torch's ``gather_object`` gives gloo views, which nothing held.)"""
    for seen in run_distributed(consolidations, 2, args=(10,)):
        assert seen == NONE_FOR_GLOO, seen
