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
from inline_schedule_ranks import STEPS, link_run, orders_run

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
    schedule = InlineSchedule()
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
    schedule = InlineSchedule()
    assert _ends(schedule, 0.6, SETTLED, bucket_bytes) == [AFTER] * SETTLED
    assert _ends(schedule, 0.6, 3, bucket_bytes) == [order] * 3
    assert schedule.chosen == order and schedule.bucket_bytes == bucket_bytes


def test_the_bucket_sizes_are_asked_once_and_only_where_they_decide() -> None:
    schedule = InlineSchedule()
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
    schedule = InlineSchedule()
    _ends(schedule, 0.05, SETTLED, 256 * 1024)
    assert schedule.order(lambda: 256 * 1024) == FILL
    _ends(schedule, 0.9, TRIALS, 256 * 1024)  # the waits got busy
    assert schedule.order(lambda: 256 * 1024) == AFTER
    _ends(schedule, 0.0, TRIALS, 256 * 1024)  # and idle again
    assert schedule.order(lambda: 256 * 1024) == FILL


def test_an_end_of_backward_that_never_blocked_tells_nothing_of_the_waits() -> None:
    schedule = InlineSchedule()
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
    block_on(_completed_after(0.1), blocked, spin)
    assert blocked[0] >= 0.09  # the timer started just before the wait
    # spinning, the waiting thread keeps its core, yielding it to any thread ready to
    # run, again and again; blocked, it gives it up once
    assert (len(yields) > 10) if spin else yields == [], len(yields)
    # the busy share is the other threads': a wait on an idle network reads idle,
    # spinning or not
    assert blocked[1] < BUSY * blocked[0], blocked


def test_a_long_wait_spins_for_a_while_then_blocks(yields: list[float]) -> None:
    blocked = [0.0, 0.0]
    started = time.perf_counter()
    block_on(_completed_after(SPIN + 0.25), blocked, spin=True)
    assert blocked[0] >= SPIN + 0.2
    assert yields and yields[-1] - started < SPIN + 0.01  # not a core spent on it all


def test_a_wait_on_a_failed_reduction_returns_and_leaves_the_error_to_its_step() -> None:
    future: torch.futures.Future[None] = torch.futures.Future()
    threading.Timer(0.01, future.set_exception, args=(RuntimeError("lost peer"),)).start()
    blocked = [0.0, 0.0]
    block_on(future, blocked, spin=True)
    assert future.done()
    with pytest.raises(RuntimeError, match="lost peer"):
        future.wait()


def test_only_idle_waits_end_the_spinning() -> None:
    schedule = InlineSchedule()
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
