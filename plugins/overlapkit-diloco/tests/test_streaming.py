"""Streaming DiLoCo (fragment_sync_delay, fragment_update_alpha) on 2 gloo ranks,
through overlapkit.post_local_sgd without torchft, against the paper's schedule by
hand (tests/ft checks it against torchft's DiLoCo)."""

from __future__ import annotations

from typing import Any

import pytest
import streaming_ranks
import torch

from overlapkit.distributed import run_distributed

CASES = ["delay0-alpha0.0", "delay2-alpha0.0", "delay2-alpha0.5"]


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(streaming_ranks.run_all, 2, timeout=180)


@pytest.mark.parametrize("case", CASES)
def test_it_is_the_papers_streaming_schedule_bitwise(
    ranks: list[dict[str, Any]], case: str
) -> None:
    for result in ranks:
        assert torch.equal(result[case], result[f"paper-{case}"]), float(
            (result[case] - result[f"paper-{case}"]).abs().max())


def test_the_delay_and_the_mixing_change_the_run(ranks: list[dict[str, Any]]) -> None:
    # the options are not ignored: each gives other parameters
    for a, b in (("delay0-alpha0.0", "delay2-alpha0.0"), ("delay2-alpha0.0", "delay2-alpha0.5")):
        assert not torch.equal(ranks[0][a], ranks[0][b])


def test_a_state_saved_with_an_allreduce_in_flight_resumes_bitwise(
    ranks: list[dict[str, Any]],
) -> None:
    saved = ranks[0]["saved_averager"]
    assert saved["step"] == 7 and saved["in_flight"]["fragment"] == 0
    assert len(saved["in_flight"]["delta"]) == 2  # the first Linear: weight and bias
    for result in ranks:
        assert torch.equal(result["resumed"], result["delay2-alpha0.5"])
