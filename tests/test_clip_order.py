"""Global-norm clipping is bitwise ``clip_grad_norm_(model.parameters(), max_norm)``
whatever the order of the optimizer's param groups: torch's total norm is a norm of the
per-tensor norms, which rounds differently in another order, so 0.2 (which clipped in
group order) was 2.98e-08 off the plain loop after 6 steps with the usual no-decay/decay
split, and 1.16e-06 with ``comm_hook="fp16_compress"``."""

from __future__ import annotations

from typing import Any

import pytest
from clip_order_ranks import SETUPS, run

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=300)


@pytest.mark.parametrize("setup", SETUPS)
def test_global_clipping_with_decay_groups_is_bitwise_the_plain_loop(
        results: list[dict[str, Any]], setup: str) -> None:
    for rank_results in results:
        assert rank_results[setup], rank_results[setup]
