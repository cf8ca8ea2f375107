"""On CPU, ``overlap_ddp`` steps its buckets at the end of backward, in runs of buckets
whose reductions have completed, one engine call per run; in the order each rank
chooses by measuring (:mod:`overlapkit.overlap.ddp.inline_schedule`). Whatever the
order, the result is bitwise plain DDP's."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
from helpers import failures
from inline_schedule_ranks import (
    STEPS,
    comm_threads_run,
    link_run,
    orders_run,
    sizes_run,
    threads_link_run,
)

from overlapkit.distributed import run_distributed
from overlapkit.overlap.ddp import inline_schedule
from overlapkit.overlap.ddp.inline_schedule import (
    AFTER,
    BUSY,
    FILL,
    FILL_FROM_BYTES,
    SETTLED,
    SPIN,
    TRIALS,
    InlineSchedule,
    block_on,
    mean_bucket_bytes,
    spare_cores,
)

MIB = float(1 << 20)


def _ends(schedule: InlineSchedule, cpu_share: float, times: int,
          bucket_bytes: float = MIB) -> list[str]:
    """``times`` ends of backward, each waiting 50 ms with ``cpu_share`` of a core busy
    (the other threads'), in buckets of ``bucket_bytes``."""
    orders = []
    for _ in range(times):
        orders.append(schedule.order(lambda: bucket_bytes))
        schedule.ended(0.05, 0.05 * cpu_share)
    return orders


@pytest.mark.parametrize("cpu_share", [0.0, 0.05, BUSY - 0.01])
@pytest.mark.parametrize("bucket_bytes", [16 * 1024, 4 * MIB])
def test_idle_waits_are_filled_with_steps(cpu_share: float, bucket_bytes: float) -> None:
    schedule = InlineSchedule(spare=True)
    # "after" until measured: two ends of backward skipped (DDP's rebuild, the state's
    # creation), then TRIALS measured
    assert _ends(schedule, cpu_share, SETTLED, bucket_bytes) == [AFTER] * SETTLED
    assert schedule.chosen == FILL and schedule.order(lambda: bucket_bytes) == FILL
    assert schedule.busy == pytest.approx(cpu_share)


@pytest.mark.parametrize(("bucket_bytes", "order"), [
    (16 * 1024, AFTER), (256 * 1024, AFTER), (FILL_FROM_BYTES - 1, AFTER),
    (FILL_FROM_BYTES, FILL), (4 * MIB, FILL), (25 * MIB, FILL)])
def test_where_the_waits_are_busy_the_bucket_size_decides(
        bucket_bytes: float, order: str) -> None:
    schedule = InlineSchedule(spare=True)
    assert _ends(schedule, 0.6, SETTLED, bucket_bytes) == [AFTER] * SETTLED
    assert _ends(schedule, 0.6, 3, bucket_bytes) == [order] * 3
    assert schedule.chosen == order and schedule.bucket_bytes == bucket_bytes


def test_the_bucket_sizes_are_asked_once_and_only_where_they_decide() -> None:
    schedule = InlineSchedule(spare=True)
    asked = []

    def sizes() -> float:
        asked.append(1)
        return 4 * MIB

    for _ in range(SETTLED):
        schedule.order(sizes)
        schedule.ended(0.05, 0.0)  # idle: the sizes do not matter
    assert schedule.order(sizes) == FILL and asked == []
    for _ in range(TRIALS):
        schedule.order(sizes)
        schedule.ended(0.05, 0.05)  # busy now
    for _ in range(5):
        assert schedule.order(sizes) == FILL
    assert asked == [1]


def test_the_order_follows_the_busy_share_of_the_last_waits() -> None:
    schedule = InlineSchedule(spare=True)
    _ends(schedule, 0.05, SETTLED, 256 * 1024)
    assert schedule.order(lambda: 256 * 1024) == FILL
    _ends(schedule, 0.9, TRIALS, 256 * 1024)  # the waits got busy
    assert schedule.order(lambda: 256 * 1024) == AFTER
    _ends(schedule, 0.0, TRIALS, 256 * 1024)  # and idle again
    assert schedule.order(lambda: 256 * 1024) == FILL


def test_an_end_of_backward_that_never_blocked_tells_nothing_of_the_waits() -> None:
    schedule = InlineSchedule(spare=True)
    for _ in range(10):
        schedule.ended(0.0, 0.0)
    assert schedule.chosen is None and schedule.waits == []


def test_buckets_mean_size_in_bytes() -> None:
    class Bucket:
        def __init__(self, tensor: torch.Tensor) -> None:
            self._tensor = tensor

        def buffer(self) -> torch.Tensor:
            return self._tensor

    pending = [(Bucket(torch.zeros(256)), None), (Bucket(torch.zeros(128, dtype=torch.half)),
                                                   None)]
    assert mean_bucket_bytes(pending) == (256 * 4 + 128 * 2) / 2


def _completed_after(seconds: float) -> torch.futures.Future[None]:
    """A future another thread completes after ``seconds``, sleeping meanwhile: a
    reduction that waits for a network (no CPU time in this process)."""
    future: torch.futures.Future[None] = torch.futures.Future()
    threading.Timer(seconds, future.set_result, args=(None,)).start()
    return future


@pytest.fixture
def yields(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When the waiting thread yields its core (``os.sched_yield``, still called)."""
    at: list[float] = []
    sched_yield = os.sched_yield

    def counted() -> None:
        at.append(time.perf_counter())
        sched_yield()

    monkeypatch.setattr(inline_schedule.os, "sched_yield", counted)
    return at


@pytest.mark.parametrize("spin", [True, False])
def test_a_wait_spins_only_where_asked_and_counts_only_the_other_threads(
        spin: bool, yields: list[float]) -> None:
    blocked = [0.0, 0.0]
    created = time.perf_counter()
    future = _completed_after(0.1)
    late = time.perf_counter() - created  # the timer ran that long before the wait
    block_on(future, blocked, spin)
    assert blocked[0] >= 0.1 - late - 0.002, (blocked, late)  # 2 ms: clock granularity
    # spinning, the waiting thread keeps its core, yielding it to any thread ready to
    # run, again and again (a loaded machine lets it run fewer times: CI ran 10 where
    # a quiet one runs hundreds); blocked, it gives it up once
    assert (len(yields) > 1) if spin else yields == [], len(yields)
    # the busy share is the other threads': a wait on an idle network reads idle,
    # spinning or not
    assert blocked[1] < BUSY * blocked[0], blocked


def test_a_long_wait_spins_for_a_while_then_blocks(yields: list[float]) -> None:
    blocked = [0.0, 0.0]
    future = _completed_after(SPIN + 0.25)
    started = time.perf_counter()
    block_on(future, blocked, spin=True)
    assert blocked[0] >= SPIN + 0.2
    assert yields and yields[-1] - started < SPIN + 0.01  # not a core spent on it all


@pytest.mark.parametrize(("spin", "after_s"), [(True, 0.01), (True, SPIN + 0.05),
                                               (False, 0.01)])
def test_a_wait_on_a_failed_reduction_returns_and_leaves_the_error_to_its_step(
        spin: bool, after_s: float) -> None:
    future: torch.futures.Future[None] = torch.futures.Future()
    threading.Timer(after_s, future.set_exception,
                    args=(RuntimeError("lost peer"),)).start()
    blocked = [0.0, 0.0]
    block_on(future, blocked, spin=spin)
    assert future.done()
    with pytest.raises(RuntimeError, match="lost peer"):
        future.wait()


def test_the_first_ends_of_backward_are_not_measured() -> None:
    schedule = InlineSchedule(spare=True)
    schedule.ended(0.05, 0.05)  # DDP's rebuild, the optimizer state's creation:
    schedule.ended(0.05, 0.05)  # what they wait for says nothing of the network
    assert schedule.waits == []
    schedule.ended(0.05, 0.0)
    assert schedule.waits == [(0.05, 0.0)]


def test_the_order_is_not_reported_before_the_bucket_sizes_are_known() -> None:
    schedule = InlineSchedule(spare=True)
    for _ in range(SETTLED):
        schedule.ended(0.05, 0.05)  # busy, but no order asked yet
    assert schedule.busy_waits and schedule.chosen is None
    assert schedule.order(lambda: 4 * MIB) == FILL and schedule.chosen == FILL


def test_without_a_core_per_thread_a_wait_never_spins() -> None:
    schedule = InlineSchedule(spare=False)
    assert not schedule.spins
    _ends(schedule, 0.9, SETTLED)
    assert not schedule.spins  # busy, but another rank needs the core


@pytest.mark.parametrize(("local_ranks", "spare"), [
    ("1", True), ("4096", False),
    ("", True), ("two", True), ("0", True)])  # not a count: the group's size (1 here)
def test_a_core_per_thread_counts_the_ranks_on_the_machine(
        monkeypatch: pytest.MonkeyPatch, local_ranks: str, spare: bool) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert spare_cores() is spare
        assert InlineSchedule().spare_cores is spare
    finally:
        torch.set_num_threads(threads)


def test_only_idle_waits_end_the_spinning() -> None:
    schedule = InlineSchedule(spare=True)
    assert schedule.spins  # not measured yet
    _ends(schedule, 0.6, 2 + TRIALS)
    assert schedule.spins  # busy: reductions that are this machine's work
    _ends(schedule, 0.0, TRIALS)
    assert not schedule.spins  # idle, as over a network: a blocked thread loses nothing


@pytest.fixture(scope="module")
def orders() -> list[dict[str, Any]]:
    return run_distributed(orders_run, 2, timeout=300)


@pytest.mark.parametrize("order", [FILL, AFTER, "None"])
def test_each_order_is_bitwise_plain_ddp(orders: list[dict[str, Any]], order: str) -> None:
    for what in ("params", "grads", "state"):
        assert failures([{what: r[order][what]} for r in orders], what) == {}
    assert all(r[order]["buckets"] >= 5 for r in orders)
    # every future DDP was given for a bucket was answered before its finalize
    assert all(r[order]["answers left"] == 0 for r in orders)


def test_buckets_reduced_by_the_end_of_backward_are_stepped_in_one_call() -> None:
    (result,) = run_distributed(orders_run, 1)
    for order in (FILL, AFTER, "None"):
        assert result[order]["buckets"] >= 5
        assert result[order]["calls"] == [1] * STEPS  # one rank: nothing in flight


def test_over_a_slow_link_each_rank_keeps_stepping_while_the_link_is_busy() -> None:
    results = run_distributed(link_run, 2, timeout=300)
    assert failures([{"params": r["params"]} for r in results], "params") == {}
    for result in results:
        # the transfers take no CPU time (measured: 0.04-0.07 of a core while waiting)
        assert result["chosen"] == FILL, (result["busy"], result["waits"])


def test_the_schedule_is_given_the_mean_size_of_the_real_buckets() -> None:
    for result in run_distributed(sizes_run, 2, timeout=300):
        assert len(result["asked"]) >= 3  # the ends of backward with reductions in flight
        assert result["asked"][-1] == pytest.approx(result["expected"]), result


def test_torchs_intra_op_threads_do_not_make_a_network_wait_read_busy() -> None:
    # they spin for milliseconds after each parallel kernel: counted as the process's
    # CPU time, an idle wait read 0.28-0.36 of a core busy here, and the rank stepped
    # "after", spinning, over a slow link
    for result in run_distributed(threads_link_run, 2, timeout=300):
        assert result["chosen"] == FILL and not result["spins"], result


def test_glooes_threads_are_found_by_name_and_their_cpu_time_read() -> None:
    for result in run_distributed(comm_threads_run, 2, timeout=120):
        assert result["found"] >= 2, result  # gloo's loop and run-loop threads
        assert result["spent"] > 0, result  # 20 allreduces of 1 MiB over loopback
        assert result["fallback"]
