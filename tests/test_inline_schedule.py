"""On CPU, ``overlap_ddp`` steps its buckets at the end of backward, in runs of buckets
whose reductions have completed, one engine call per run; in the order each rank
chooses from the CPU time its reductions take
(:mod:`overlapkit.overlap.ddp.inline_schedule`). Whatever the
order, the result is bitwise plain DDP's."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import failures
from inline_schedule_ranks import STEPS, link_run, orders_run

from overlapkit.distributed import run_distributed
from overlapkit.overlap.ddp.inline_schedule import AFTER, BUSY, FILL, TRIALS, InlineSchedule


def _measure(schedule: InlineSchedule, cpu_share: float, times: int) -> list[str]:
    orders = []
    for _ in range(times):
        orders.append(schedule.order())
        schedule.waited(0.05, 0.05 * cpu_share)
    return orders


@pytest.mark.parametrize(("cpu_share", "chosen"),
                         [(0.05, FILL), (BUSY - 0.01, FILL), (BUSY, AFTER), (0.8, AFTER)])
def test_the_order_is_after_where_the_waits_keep_a_core_busy(cpu_share: float,
                                                             chosen: str) -> None:
    schedule = InlineSchedule()
    # "after" until measured: two ends of backward skipped (DDP's rebuild, the state's
    # creation), then TRIALS measured
    assert _measure(schedule, cpu_share, 2 + TRIALS) == [AFTER] * (2 + TRIALS)
    assert schedule.chosen == chosen and schedule.order() == chosen
    assert len(schedule.waits) == TRIALS
    assert schedule.busy == pytest.approx(cpu_share)


def test_the_order_follows_the_last_waits() -> None:
    schedule = InlineSchedule()
    _measure(schedule, 0.05, 2 + TRIALS)
    assert schedule.order() == FILL
    _measure(schedule, 0.9, 1)  # one busy end of backward among the last TRIALS
    assert schedule.order() == (AFTER if (0.9 + 0.05 * (TRIALS - 1)) / TRIALS >= BUSY
                                else FILL)
    _measure(schedule, 0.9, TRIALS)  # the network got busy: stepping waits for it
    assert schedule.order() == AFTER and schedule.busy == pytest.approx(0.9)
    _measure(schedule, 0.0, TRIALS)  # and idle again
    assert schedule.order() == FILL


def test_an_end_of_backward_that_never_blocked_tells_nothing() -> None:
    schedule = InlineSchedule()
    _measure(schedule, 0.05, 2)
    for _ in range(10):
        schedule.waited(0.0, 0.0)
    assert schedule.chosen is None and schedule.waits == []


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
