"""Accelerate's ``accumulate`` with ``clip_grad_norm_`` after every micro-batch's
backward (twelfth round): bitwise the plain run (parameters, Adam's state, the norms
each clip returned), one warning that says the clip ran after each backward of one
step; at ``cdd1705`` it said "clip_grad_norm_ was called again after the loop's clip",
a second clip the loop never made. 1 process (optimizer_in_backward) and 2 gloo ranks
(both techniques). Rank code: accelerate_clip_runs.py."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("accelerate", reason="the `trainers` tox environment installs it")

from accelerate_clip_runs import compare_runs, run
from trainer_helpers import check_plain_order

from overlapkit.distributed import run_distributed

NAMED = "clip_grad_norm_ was called after each backward of one step"


def test_one_process_clipping_every_micro_batch_is_the_plain_run_warned_as_such() -> None:
    result = compare_runs(("optimizer_in_backward",))["optimizer_in_backward"]
    check_plain_order(result, NAMED)
    assert "called again after the loop's clip" not in result[2][0]


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_two_ranks_clipping_every_micro_batch_is_the_plain_run_warned_as_such(
        technique: str, two_ranks: list[dict[str, Any]]) -> None:
    for rank_results in two_ranks:
        check_plain_order(rank_results[technique], NAMED)
        assert "called again after the loop's clip" not in rank_results[technique][2][0]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=600)
