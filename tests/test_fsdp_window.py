"""The window between backward and ``step()`` on an FSDP2 model (``fully_shard``, 2 gloo
ranks), ``optimizer_in_backward``: a loop told to ``learn_first_step`` that adds gradient
noise or reads gradient norms there is stepped in the plain order, bitwise the plain
loop, with one warning (0.4.0 until this test: a raw RuntimeError from inside backward,
``as_subclass`` of a ``DTensor`` gradient); one that does nothing there keeps the overlap,
bitwise; a warm-up written there without it is refused at the first ``step()``. An EMA
of the ``DTensor`` parameters updated there: learnt, the plain order, bitwise, one
warning; else warned of once (before: not watched, the EMA 0.0027 and 0.010 off the
plain loop's after 4 steps, silently). A new
optimizer on the same model after ``release()``, overlapped or plain, continues bitwise;
a plain one stepping it while the overlapped one holds it is refused before it steps."""

from __future__ import annotations

from typing import Any

import pytest
from fsdp_window_ranks import run

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=300)


@pytest.mark.parametrize("window", ["noise", "norms read"])
def test_a_learnt_loop_using_the_window_is_stepped_in_the_plain_order_bitwise(
        two_ranks: list[dict[str, Any]], window: str) -> None:
    for rank_results in two_ranks:
        found = rank_results[f"{window} learn=True"]
        assert found["error"] is None, found
        assert found["bitwise plain"], found
        assert len(found["warnings"]) == 1, found["warnings"]
        assert "optimizer_in_backward takes every step" in found["warnings"][0]


def test_a_learnt_loop_that_leaves_the_window_alone_keeps_the_overlap_bitwise(
        two_ranks: list[dict[str, Any]]) -> None:
    for rank_results in two_ranks:
        for learn in (True, False):
            found = rank_results[f"nothing learn={learn}"]
            assert found["error"] is None and found["bitwise plain"], found
            assert found["warnings"] == [], found


def test_a_warm_up_in_the_window_is_learnt_or_refused_at_the_first_step(
        two_ranks: list[dict[str, Any]]) -> None:
    for rank_results in two_ranks:
        learnt = rank_results["warm-up learn=True"]
        assert learnt["error"] is None and learnt["bitwise plain"], learnt
        refused = rank_results["warm-up learn=False"]
        assert refused["at"] == 0, refused
        assert refused["error"]["type"] == "ConfigurationError"
        assert "lr of param group 0" in refused["error"]["message"]


def test_an_ema_of_dtensor_parameters_in_a_learnt_window_keeps_the_plain_order_bitwise(
        two_ranks: list[dict[str, Any]]) -> None:
    # before: FSDP2's DTensor parameters were not watched: the EMA 0.0027 off the plain
    # loop's after 4 AdamW steps, learnt, and 0.010 unlearnt, neither warned of
    for rank_results in two_ranks:
        found = rank_results["ema learn=True"]
        assert found["ema bitwise"] and found["bitwise plain"], found
        assert len(found["warnings"]) == 1, found["warnings"]
        assert "in the plain order" in found["warnings"][0]
        assert "were read" in found["warnings"][0]


def test_an_ema_of_dtensor_parameters_in_a_window_not_learnt_is_warned_of_once(
        two_ranks: list[dict[str, Any]]) -> None:
    for rank_results in two_ranks:
        found = rank_results["ema learn=False"]
        assert found["bitwise plain"], found  # the model: the EMA is one step ahead
        assert [w.split(":")[0] for w in found["warnings"]] == [
            "ParameterReadInWindowWarning"], found["warnings"]


@pytest.mark.parametrize("how", ["rebuilt", "plain after release"])
def test_a_new_optimizer_after_release_continues_bitwise(
        two_ranks: list[dict[str, Any]], how: str) -> None:
    for rank_results in two_ranks:
        assert rank_results[how], rank_results[how]


def test_a_plain_optimizer_on_held_parameters_is_refused_before_it_steps(
        two_ranks: list[dict[str, Any]]) -> None:
    for rank_results in two_ranks:
        found = rank_results["plain while held"]
        assert found["error"]["type"] == "ConfigurationError", found
        assert "release()" in found["error"]["message"]
        assert found["unchanged by it"], found
