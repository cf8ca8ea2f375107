"""On CPU, ``overlap_ddp`` steps its buckets at the end of backward, in runs of buckets
whose reductions have completed, one engine call per run; in the order each rank
chooses by measuring (:mod:`overlapkit.overlap.ddp.inline_schedule`). Whatever the
order, the result is bitwise plain DDP's."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from helpers import failures
from inline_schedule_ranks import STEPS, link_run, orders_run

from overlapkit.distributed import run_distributed
from overlapkit.overlap.ddp.inline_schedule import (
    AFTER,
    BUSY,
    FILL,
    SPIN,
    TIMED,
    TRIALS,
    InlineSchedule,
    block_on,
    fill_wins,
)


def _ends(schedule: InlineSchedule, cpu_share: float, times: int,
          seconds: dict[str, float] | None = None) -> list[str]:
    """``times`` ends of backward, each blocking 50 ms with ``cpu_share`` of a core busy
    and lasting ``seconds[order]``."""
    orders = []
    for _ in range(times):
        order = schedule.order()
        orders.append(order)
        schedule.ended(order, (seconds or {}).get(order, 0.1), 0.05, 0.05 * cpu_share)
    return orders


@pytest.mark.parametrize("cpu_share", [0.0, 0.05, BUSY - 0.01])
def test_idle_waits_are_filled_with_steps(cpu_share: float) -> None:
    schedule = InlineSchedule()
    # "after" until measured: two ends of backward skipped (DDP's rebuild, the state's
    # creation), then TRIALS measured
    assert _ends(schedule, cpu_share, 2 + TRIALS) == [AFTER] * (2 + TRIALS)
    assert schedule.chosen == FILL and schedule.order() == FILL
    assert schedule.busy == pytest.approx(cpu_share)
    assert schedule.trials == {FILL: [], AFTER: []}  # nothing to time


@pytest.mark.parametrize(("fill_s", "after_s", "faster"),
                         [(0.05, 0.08, FILL), (0.08, 0.05, AFTER), (0.05, 0.05, AFTER)])
def test_where_the_waits_are_busy_both_orders_are_timed_in_turn(
        fill_s: float, after_s: float, faster: str) -> None:
    schedule = InlineSchedule()
    seconds = {FILL: fill_s, AFTER: after_s}
    _ends(schedule, 0.6, 2 + TRIALS, seconds)
    assert schedule.chosen is None  # busy: timed next
    assert _ends(schedule, 0.6, 2 * TIMED, seconds) == [FILL, AFTER] * TIMED
    assert schedule.chosen == faster and schedule.faster == faster
    assert schedule.trials == {FILL: [fill_s] * TIMED, AFTER: [after_s] * TIMED}
    assert _ends(schedule, 0.6, 3, seconds) == [faster] * 3


def test_the_median_of_the_turns_decides_not_one_slow_turn() -> None:
    schedule = InlineSchedule()
    _ends(schedule, 0.6, 2 + TRIALS)
    for index in range(2 * TIMED):
        order = schedule.order()
        # fill is faster, but one of its turns met a peer arriving late
        late = order == FILL and index == 2
        schedule.ended(order, 0.9 if late else {FILL: 0.04, AFTER: 0.06}[order], 0.05, 0.03)
    assert schedule.chosen == FILL


@pytest.mark.parametrize(("fill", "after", "kept"), [
    # the turns of the 100-bucket model above, rank 0 (ms): fill's median is the
    # shorter, but the turns overlap: noise, and "after" is kept
    ([40, 53, 72, 143, 54], [129, 44, 83, 56, 46], AFTER),
    ([20, 30, 27, 18, 31], [22, 17, 19, 21, 20], AFTER),
    # fill faster in 20 of 25 pairs (one slow turn): kept
    ([40, 41, 42, 43, 90], [50, 51, 52, 53, 54], FILL),
    ([40, 41, 42, 50.5, 90], [50, 51, 52, 53, 54], AFTER),  # 19 of 25: not
])
def test_fill_is_kept_only_where_its_turns_are_faster_beyond_noise(
        fill: list[float], after: list[float], kept: str) -> None:
    assert (FILL if fill_wins(fill, after) else AFTER) == kept
    schedule = InlineSchedule()
    _ends(schedule, 0.6, 2 + TRIALS)
    turns = {FILL: iter(fill), AFTER: iter(after)}
    for _ in range(2 * TIMED):
        order = schedule.order()
        schedule.ended(order, next(turns[order]) / 1000, 0.05, 0.03)
    assert schedule.chosen == kept


def test_the_order_follows_the_busy_share_of_the_last_waits() -> None:
    schedule = InlineSchedule()
    _ends(schedule, 0.05, 2 + TRIALS)
    assert schedule.order() == FILL
    _ends(schedule, 0.9, TRIALS, {FILL: 0.09, AFTER: 0.05})  # the waits got busy
    assert schedule.chosen is None  # timed now
    _ends(schedule, 0.9, 2 * TIMED, {FILL: 0.09, AFTER: 0.05})
    assert schedule.order() == AFTER
    _ends(schedule, 0.0, TRIALS)  # and idle again
    assert schedule.order() == FILL


def test_an_end_of_backward_that_never_blocked_tells_nothing_of_the_waits() -> None:
    schedule = InlineSchedule()
    for _ in range(10):
        schedule.ended(AFTER, 0.01, 0.0, 0.0)
    assert schedule.chosen is None and schedule.waits == []


def _completed_after(seconds: float) -> torch.futures.Future[None]:
    """A future another thread completes after ``seconds``, sleeping meanwhile: a
    reduction that waits for a network (no CPU time in this process)."""
    future: torch.futures.Future[None] = torch.futures.Future()
    threading.Timer(seconds, future.set_result, args=(None,)).start()
    return future


@pytest.mark.parametrize("spin", [True, False])
def test_a_wait_spins_only_where_asked_and_counts_only_the_other_threads(
        spin: bool) -> None:
    blocked = [0.0, 0.0]
    own = time.thread_time()
    block_on(_completed_after(0.03), blocked, spin)
    own = time.thread_time() - own
    assert blocked[0] >= 0.03
    # spinning, the waiting thread keeps its core (yielding it to any thread ready to
    # run); blocked, it gives it up
    assert (own > 0.5 * blocked[0]) if spin else (own < 0.2 * blocked[0]), (own, blocked)
    # the busy share is the other threads': a wait on an idle network reads idle,
    # spinning or not
    assert blocked[1] < BUSY * blocked[0], blocked


def test_a_long_wait_spins_for_a_while_then_blocks() -> None:
    blocked = [0.0, 0.0]
    own = time.thread_time()
    block_on(_completed_after(SPIN + 0.25), blocked, spin=True)
    own = time.thread_time() - own
    assert blocked[0] >= SPIN + 0.25
    assert own < SPIN + 0.1, own  # not a core spent on the whole wait


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
