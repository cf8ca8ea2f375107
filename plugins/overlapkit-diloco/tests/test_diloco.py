"""The DiLoCo averager on 2 gloo ranks, through overlapkit.post_local_sgd."""

from __future__ import annotations

from typing import Any

import diloco_ranks
import pytest
import torch

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(diloco_ranks.run_all, 2, timeout=180)


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_with_warmup_it_is_the_papers_algorithm_1_bitwise(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert torch.equal(result["diloco"], result["paper"]), _difference(
            result["diloco"], result["paper"])


def test_without_warmup_it_is_the_papers_algorithm_1_bitwise(
    ranks: list[dict[str, Any]],
) -> None:
    for result in ranks:
        assert torch.equal(result["no_warmup"], result["paper_no_warmup"]), _difference(
            result["no_warmup"], result["paper_no_warmup"])


def test_an_overlapped_inner_optimizer_starts_the_first_round_before_its_first_step(
    ranks: list[dict[str, Any]],
) -> None:
    for result in ranks:
        assert torch.equal(result["overlapped"], result["paper_no_warmup"]), _difference(
            result["overlapped"], result["paper_no_warmup"])
        assert result["overlapped warnings"] == []


def test_an_overlapped_inner_optimizer_with_warmup_starts_the_round_at_its_end(
    ranks: list[dict[str, Any]],
) -> None:
    for result in ranks:
        assert torch.equal(result["overlapped warmup"], result["plain warmup"]), _difference(
            result["overlapped warmup"], result["plain warmup"])
        assert result["overlapped warmup warnings"] == []


def test_first_round_without_warmup_or_start_is_refused(ranks: list[dict[str, Any]]) -> None:
    assert "before_step" in ranks[0]["unstarted_error"]


def test_nesterov_outer_step_matches_the_formula(ranks: list[dict[str, Any]]) -> None:
    # The formula is evaluated in float64; the averager works in float32.
    for result in ranks:
        assert result["nesterov_max_error"] < 1e-5


def test_ranks_agree_after_the_last_outer_step(ranks: list[dict[str, Any]]) -> None:
    # 12 steps, warm-up 2, period 3: outer steps after steps 5, 8 and 11 (counted from
    # 1); the 12th is an inner step, so the ranks differ at the end.
    assert not torch.equal(ranks[0]["diloco"], ranks[1]["diloco"])
    # Without warm-up the 12th step ends the 4th round.
    assert torch.equal(ranks[0]["no_warmup"], ranks[1]["no_warmup"])


def test_resumed_run_matches_the_uninterrupted_one(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert torch.equal(result["resumed"], result["diloco"])


def test_state_dict_holds_the_round_start_and_outer_momentum(
    ranks: list[dict[str, Any]],
) -> None:
    saved = ranks[0]["saved_averager"]
    assert saved["step"] == 7
    assert len(saved["round_start"]) == 4  # two Linear layers: weight and bias each
    momentum = [s["momentum_buffer"] for s in saved["outer_optimizer"]["state"].values()]
    assert len(momentum) == 4 and all(m.abs().sum() > 0 for m in momentum)
