"""Errors inside backward, on 2 gloo ranks: an optimizer step that raises reaches the
user on every rank as the original error and the ranks stay in step (a barrier right
after works and training goes on exactly as plain DDP's after its step() raised); and
optimizer_in_backward called before DDP wrapped the module is refused, never silent."""

from __future__ import annotations

from typing import Any

import pytest
from backward_errors_ranks import FAILING_STEP, sharded_after, step_errors, wrapped_after

from overlapkit.distributed import run_distributed

TECHNIQUES = ["overlap_ddp backward", "overlap_ddp comm", "optimizer_in_backward ddp",
              "overlap_ddp fp16_compress"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("step-errors"))
    return run_distributed(step_errors, 2, args=(directory,), timeout=240)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_the_original_error_reaches_every_rank(results: list[dict[str, Any]],
                                               technique: str) -> None:
    for rank_results in results:
        assert rank_results[technique]["errors"] == [(FAILING_STEP, "injected step failure")]
        assert rank_results["plain errors"] == [(FAILING_STEP, "injected step failure")]


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_training_goes_on_exactly_as_plain_ddp(results: list[dict[str, Any]],
                                               technique: str) -> None:
    for rank_results in results:
        same = rank_results[technique]["same as plain"]
        assert same, same


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_the_gradients_after_the_error_are_the_reduced_ones_as_with_plain_ddp(
        results: list[dict[str, Any]], technique: str) -> None:
    for rank_results in results:
        same = rank_results[technique]["same gradients"]
        assert same, same


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_a_checkpoint_save_right_after_the_error_works(results: list[dict[str, Any]],
                                                       technique: str) -> None:
    for rank_results in results:
        assert rank_results["plain save error"] is None, rank_results["plain save error"]
        assert rank_results[technique]["save error"] is None, rank_results[technique]


def test_on_a_plain_module_the_error_reaches_the_caller(results: list[dict[str, Any]]
                                                        ) -> None:
    for rank_results in results:
        error = rank_results["plain module"]["error"]
        assert error is not None and error["type"] == "RuntimeError", error
        assert "injected step failure" in error["message"]
        assert rank_results["plain module"]["unchanged"]


def test_optimizer_in_backward_before_ddp_is_refused_at_the_first_forward() -> None:
    for rank_results in run_distributed(wrapped_after, 2, timeout=120):
        error = rank_results["error"]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "before DistributedDataParallel wrapped it" in error["message"]
        assert "optimizer_in_backward(ddp" in error["message"]
        assert rank_results["unchanged"], rank_results["unchanged"]


def test_optimizer_in_backward_before_fully_shard_is_refused_at_the_first_forward() -> None:
    for rank_results in run_distributed(sharded_after, 2, timeout=120):
        error = rank_results["error"]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "no longer the one optimizer_in_backward was set up on" in error["message"]
        assert "fully_shard(model); opt = optimizer_in_backward(model" in error["message"]
        assert rank_results["unchanged"], rank_results["unchanged"]
