"""``ddp_model.join(divide_by_initial_world_size=False)`` (twelfth round of the window
in hand-written loops, 2 gloo ranks, uneven inputs). Plain DDP divides the gradients by
the ranks not joined yet; with a comm hook registered (overlapkit's, which steps each
bucket) the reducer leaves the division to the hook, which divides by the initial
world size. Before (``cdd1705``): silently off the plain loop once a rank had joined
(AdamW 0.0063 after 5 steps, both techniques). Now refused at the first forward under
such a join, on every rank, before anything stepped; ``join()`` with the default still
trains bitwise as plain DDP.
"""

from __future__ import annotations

from typing import Any

import pytest
from join_divide_ranks import run

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def ranks() -> list[dict[Any, dict[str, Any]]]:
    return run_distributed(run, 2, timeout=300)


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_join_dividing_by_remaining_ranks_is_refused_before_a_step(
        ranks: list[dict[Any, dict[str, Any]]], technique: str) -> None:
    for rank, results in enumerate(ranks):
        result = results[technique, False]
        assert result["plain error"] is None
        assert result["error"] is not None, (rank, result["equal"])
        assert result["error"]["type"] == "ConfigurationError", result["error"]
        assert "divide_by_initial_world_size=False" in result["error"]["message"]
        assert result["unchanged"], (rank, result["unchanged"])
        assert result["state"] == 0
        assert all(grad is None for grad in result["grads"])


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_join_by_the_initial_world_size_is_plain_ddp(
        ranks: list[dict[Any, dict[str, Any]]], technique: str) -> None:
    for rank, results in enumerate(ranks):
        result = results[technique, True]
        assert result["error"] is None, (rank, result["error"])
        assert result["equal"], (rank, result["equal"])
