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


@pytest.mark.parametrize(("cpu_share", "chosen"),
                         [(0.05, FILL), (BUSY - 0.01, FILL), (BUSY, AFTER), (0.8, AFTER)])
def test_the_schedule_keeps_stepping_after_where_the_wait_keeps_a_core_busy(
        cpu_share: float, chosen: str) -> None:
    schedule = InlineSchedule()
    orders = []
    for wall in [0.05] * 2 + [0.04, 0.06, 0.05][:TRIALS]:
        orders.append(schedule.order())
        schedule.waited(wall, wall * cpu_share)
    # measured in "after": two ends of backward skipped (DDP's rebuild, the state's
    # creation), then TRIALS waits
    assert orders == [AFTER] * (2 + TRIALS)
    assert schedule.chosen == chosen
    assert len(schedule.waits) == TRIALS
    assert schedule.busy == pytest.approx(cpu_share)
    schedule.waited(1.0, 1.0)  # nothing changes once chosen
    assert schedule.order() == chosen and len(schedule.waits) == TRIALS


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
