"""The window between backward and ``step()`` in a loop that steps during backward: a
gradient the loop changes (in place, or replaced — a freed one set again) after the
backward that stepped it, before ``step()``, could not reach that step. It is refused
at that ``step()`` with a ``ConfigurationError`` naming what to do, on every rank, for
both techniques (0.3: silently ignored, or a raw error). Integrations learn the loop at
its first step instead (tests/trainers/huggingface/test_accelerate_window.py)."""

from __future__ import annotations

from typing import Any

import pytest
from window_ranks import run

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=300)


# optimizer_in_backward frees each gradient once stepped: there is nothing to change
# in place, only a freed one to set again
@pytest.mark.parametrize(("technique", "edit"), [
    ("overlap_ddp", "in place"), ("overlap_ddp", "replaced"),
    ("optimizer_in_backward", "replaced")])
def test_a_gradient_changed_after_it_was_stepped_is_refused_at_step_on_every_rank(
        two_ranks: list[dict[str, Any]], technique: str, edit: str) -> None:
    for rank_results in two_ranks:
        error = rank_results[f"{technique} {edit}"]
        assert error is not None
        assert error["type"] == "ConfigurationError", error
        assert "were changed between backward() and optimizer.step()" in error["message"]
        assert "missed this step" in error["message"]


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_an_unchanged_gradient_steps_as_before(two_ranks: list[dict[str, Any]],
                                               technique: str) -> None:
    for rank_results in two_ranks:
        assert rank_results[f"{technique} none"] is None
