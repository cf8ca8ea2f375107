"""Resume real training, bitwise (2 gloo ranks): BatchNorm buffers under DDP come back
as rank 0's (what DDP broadcasts), parameters that never got a gradient come back
without optimizer state, an output the loss ignores is not stepped, and an LR
scheduler may be built before or after loading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import failures
from resume_ranks import run

from overlapkit.distributed import run_distributed

TECHNIQUES = ["plain", "overlap_ddp", "optimizer_in_backward"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory: Path = tmp_path_factory.mktemp("resume")
    return run_distributed(run, 2, args=(str(directory),), timeout=240)


@pytest.mark.parametrize("technique", TECHNIQUES)
@pytest.mark.parametrize("kind", ["bn", "unused"])
def test_the_resumed_run_equals_the_uninterrupted_one(results: list[dict[str, Any]],
                                                      kind: str, technique: str) -> None:
    assert failures(results, f"{kind} {technique} resumed") == {}


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("kind", ["bn", "unused"])
def test_training_equals_plain_ddp(results: list[dict[str, Any]], kind: str,
                                   technique: str) -> None:
    # "unused": a pooler output the loss ignores gets an undefined gradient through
    # DDP's find_unused_parameters sink; with weight decay, stepping it would move it
    assert failures(results, f"{kind} {technique}") == {}


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_parameters_without_gradients_get_no_state_from_a_load(
        results: list[dict[str, Any]], technique: str) -> None:
    for rank_results in results:
        assert sorted(rank_results[f"unused {technique} no state after load"]) == [
            "never.bias", "never.weight", "pooler.bias", "pooler.weight"]
