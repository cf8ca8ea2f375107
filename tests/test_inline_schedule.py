"""On CPU, ``overlap_ddp`` steps its buckets at the end of backward, in runs of buckets
whose reductions have completed, one engine call per run; in the order each rank
chooses by timing both (:mod:`overlapkit.overlap.ddp.inline_schedule`). Whatever the
order, the result is bitwise plain DDP's."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import failures
from inline_schedule_ranks import STEPS, link_run, orders_run

from overlapkit.distributed import run_distributed
from overlapkit.overlap.ddp.inline_schedule import AFTER, FILL, TRIALS, InlineSchedule


def _feed(schedule: InlineSchedule, times: dict[str, float], count: int) -> list[str]:
    orders = []
    for _ in range(count):
        order = schedule.order()
        orders.append(order)
        schedule.timed(order, times[order])
    return orders


@pytest.mark.parametrize(("fill_s", "after_s", "chosen"),
                         [(0.05, 0.08, FILL), (0.08, 0.05, AFTER), (0.05, 0.05, FILL)])
def test_the_schedule_times_both_orders_then_keeps_the_faster(
        fill_s: float, after_s: float, chosen: str) -> None:
    schedule = InlineSchedule()
    orders = _feed(schedule, {FILL: fill_s, AFTER: after_s}, 2 + 2 * TRIALS)
    # two ends of backward not timed (DDP's rebuild, the state's creation), then turns
    assert orders == [FILL, FILL] + [FILL, AFTER] * TRIALS
    assert schedule.chosen == chosen
    assert _feed(schedule, {FILL: 1.0, AFTER: 1.0}, 3) == [chosen] * 3
    assert schedule.trials == {FILL: [fill_s] * TRIALS, AFTER: [after_s] * TRIALS}


def test_the_fastest_trial_counts_not_a_slow_one() -> None:
    schedule = InlineSchedule()
    for order in [FILL, FILL] + [FILL, AFTER] * TRIALS:
        # fill is faster, but one of its trials met a load spike
        spike = order == FILL and len(schedule.trials[FILL]) == 1
        schedule.timed(schedule.order(), 0.9 if spike else {FILL: 0.04, AFTER: 0.06}[order])
    assert schedule.chosen == FILL


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
        assert result["chosen"] == FILL, result["trials"]
