"""Lightning fits that work around the window, at 1 process (OverlapSingleDeviceStrategy,
OverlapDDPStrategy with both techniques) and 2 gloo ranks (both techniques), bitwise
the plain strategy's: ``on_after_backward`` changing ``.grad`` (the module's) and reading
the parameters and optimizer state (a callback's), an ``optimizer_step`` override whose
closure wraps Lightning's and clips and reads the parameters after its backward (was
refused after the parameters changed, or a raw AttributeError, or silently off; now the
plain order from that step, one warning), a ``save_last`` checkpoint resumed with
``ckpt_path="last"`` (against the plain uninterrupted fit), ``LearningRateFinder`` as a
callback, SequentialLR and ReduceLROnPlateau, and ``validate`` / ``test`` / ``predict``
between two fits of one module. A gradient changed through ``.data`` (no version counter
bumped) under ``hooks_read_only_grads=True`` is refused before anything steps (it was
silently 0.0093 off), as are the parameters read there (weight norms logged). A cached,
GradCache-style loss (a hook on the loss running the chunks' backwards, nested in
Lightning's): the plain order, one warning (2 ranks, overlap_ddp: was refused at the
second step after its chunks had stepped, the parameters 0.0070 from the start), refused
before anything steps under optimizer_in_backward on DDP (was a refusal naming
find_unused_parameters). Rank code: lightning_window_ranks.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the `trainers` tox environment installs lightning")

from lightning_window_ranks import CASES, PAIRS, WARNED, run

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module", params=[1, 2], ids=["1 process", "2 ranks"])
def results(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict[str, Any]]]:
    world_size: int = request.param
    root: Path = tmp_path_factory.mktemp(f"lightning_window_{world_size}")
    return world_size, run_distributed(run, world_size, args=(str(root),), timeout=400)


@pytest.mark.parametrize("case", list(CASES))
def test_the_fit_is_the_plain_strategys_bitwise_warned_only_in_the_plain_order(
        results: tuple[int, list[dict[str, Any]]], case: str) -> None:
    world_size, ranks = results
    for rank, rank_results in enumerate(ranks):
        for label in PAIRS[world_size]:
            assert rank_results[f"{label} | {case}"], (rank, label)
            warned = rank_results[f"{label} | {case} | warnings"]
            if case in WARNED:
                assert len(warned) == 1 and WARNED[case] in warned[0], (label, warned)
            else:
                assert warned == [], (label, warned)


def test_a_gradient_changed_through_data_under_hooks_read_only_grads_is_refused(
        results: tuple[int, list[dict[str, Any]]]) -> None:
    """``p.grad.data.mul_()`` bumps no version counter: the values are compared too."""
    _, ranks = results
    for rank_results in ranks:
        result = rank_results["refused through .data"]
        error = result["error"]
        assert error is not None and error["overlapkit"], error
        assert "ScalesThroughData.on_after_backward changed the gradient" in error["message"]
        assert result["unchanged"], result["unchanged"]


def test_parameters_read_by_a_hook_under_hooks_read_only_grads_are_refused(
        results: tuple[int, list[dict[str, Any]]]) -> None:
    """A callback logging weight norms in on_before_optimizer_step reads no gradient."""
    _, ranks = results
    for rank_results in ranks:
        result = rank_results["refused reading the parameters"]
        error = result["error"]
        assert error is not None and error["overlapkit"], error
        assert "LogsWeightNorms.on_before_optimizer_step read the values of" in (
            error["message"])
        assert result["unchanged"], result["unchanged"]


def test_a_batch_skipped_at_the_end_of_an_accumulation_window_on_one_process(
        results: tuple[int, list[dict[str, Any]]]) -> None:
    """training_step returning None where a window ends leaves DDP's reducer prepared:
    overlap_ddp takes the rest in the plain order, bitwise, one warning (it stepped an
    extra step, then was refused); optimizer_in_backward is refused at that step."""
    world_size, ranks = results
    if world_size > 1:
        pytest.skip("Lightning refuses training_step returning None on several ranks")
    result = ranks[0]["a skipped batch ends a window"]
    assert result["errors"] == [None, None], result["errors"]
    assert result["overlap_ddp"], result["overlap_ddp"]
    assert len(result["overlap_ddp warnings"]) == 1
    assert "training_step returned None" in result["overlap_ddp warnings"][0]
    assert result["one device"] and result["one device warnings"] == []
    refusal = result["refusal"]
    assert refusal is not None and refusal["overlapkit"], refusal
    assert "training_step returned None" in refusal["message"], refusal["message"]


def test_a_cached_loss_is_stepped_in_the_plain_order_or_refused_before_any_step(
        results: tuple[int, list[dict[str, Any]]]) -> None:
    """A hook on the loss runs backwards during Lightning's: seen after training_step,
    before its backward. optimizer_in_backward on DDP frees the local gradients the
    chunks add up: refused there, nothing changed."""
    world_size, ranks = results
    for rank_results in ranks:
        result = rank_results["a cached loss"]
        for label in ("overlap_ddp", "one device") if world_size == 1 else ("overlap_ddp",):
            same, warned, error = result[label]
            assert error is None, (label, error)
            assert same, (label, same)
            assert len(warned) == 1 and "returned a loss with a hook on it" in warned[0], (
                label, warned)
        refusal, unchanged = result["refusal"]
        assert refusal is not None and refusal["overlapkit"], refusal
        assert "returned a loss with a hook on it" in refusal["message"], refusal
        assert "Nothing was stepped" in refusal["message"], refusal
        assert unchanged, unchanged
