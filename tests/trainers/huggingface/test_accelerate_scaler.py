"""A hand-written AMP loop's own ``torch.amp.GradScaler`` driving the optimizer
``overlapkit.integrations.accelerate.prepare`` returned (the ninth trainers round; see
``accelerate_scaler_runs``). Before: ``overlap_ddp`` silently 0.030 off the plain run
after 4 AdamW steps (2 gloo ranks: 0.030), NaN parameters after an overflowing step
the scaler skips, 0.021 off with the scaler first used at the third step;
``optimizer_in_backward`` bitwise from the first step (the gradient reads seen), torch's
bare ``AssertionError`` from the third. Now: from the first step, the plain order,
bitwise (parameters and scales), one warning naming the scaler; first used once the
steps happen during backward, a ``ConfigurationError`` before the scaler touches a
gradient; and one driving the wrapper of an optimizer set up with ``grad_scaler=``
(before: 0.0012 off after 4 steps, both techniques, warned of only as gradient reads),
which would unscale twice, is refused before it touches a gradient."""

from __future__ import annotations

import math
from typing import Any

import pytest
from accelerate_scaler_runs import AFTER, CASES, KEPT, REFUSED, compare, compare_after, run

from overlapkit.distributed import run_distributed

pytestmark = pytest.mark.trainers

HONOURED = CASES[:3]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=300)


def _honoured(result: dict[str, Any]) -> None:
    assert result["error"] is None, result["error"]
    assert result["same"], result["diff"]
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "a torch.amp.GradScaler drove the AcceleratedOptimizer" in result["warnings"][0]


def _refused(result: dict[str, Any]) -> None:
    error = result["error"]
    assert error is not None and error["type"] == "ConfigurationError", error
    assert "GradScaler drives the AcceleratedOptimizer" in error["message"]
    assert "Nothing was changed" in error["message"] and "grad_scaler=" in error["message"]
    assert result["unchanged"]


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("case", HONOURED)
def test_two_ranks_a_scaler_from_the_first_step_is_the_plain_run_with_one_warning(
        two_ranks: list[dict[str, Any]], case: str, technique: str) -> None:
    for rank_results in two_ranks:
        _honoured(rank_results[case][technique])


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("case", REFUSED)
def test_two_ranks_a_scaler_first_used_once_overlapping_or_unscaling_twice_is_refused(
        two_ranks: list[dict[str, Any]], case: str, technique: str) -> None:
    for rank_results in two_ranks:
        _refused(rank_results[case][technique])


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_two_ranks_the_scaler_set_up_driving_the_optimizer_inside_keeps_the_overlap(
        two_ranks: list[dict[str, Any]], technique: str) -> None:
    """The refusal's advice (grad_scaler= to prepare, scaler.step(optimizer.optimizer)):
    before, the scaler's own inf check was taken for a read of the gradients in the
    learnt first step, and the run turned to the plain order with a warning saying so."""
    for rank_results in two_ranks:
        result = rank_results[KEPT][technique]
        assert result["error"] is None and result["same"], result
        assert result["warnings"] == [] and result["overlapping"]


def test_one_process_optimizer_in_backward() -> None:
    for case in HONOURED:
        _honoured(compare(case, ("optimizer_in_backward",))["optimizer_in_backward"])
    for case in REFUSED:
        _refused(compare(case, ("optimizer_in_backward",))["optimizer_in_backward"])


def _after(result: dict[str, Any], mode: str) -> None:
    if mode == "released":  # its step() is a plain step: the plain run
        assert result["error"] is None and result["same"], result
        return
    error = result["error"]
    assert error is not None and error["type"] == "ConfigurationError", error
    assert "was replaced by a later" in error["message"] and "scaler." in error["message"]
    assert result["unchanged"], "the scaler unscaled the gradients before the refusal"


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("call", ["step", "unscale_"])
@pytest.mark.parametrize("mode", AFTER)
def test_two_ranks_a_scaler_on_a_released_or_replaced_optimizer(
        two_ranks: list[dict[str, Any]], mode: str, call: str, technique: str) -> None:
    """Before: replaced, refused only at its step() after the scaler unscaled the
    gradients the new call steps (overlap_ddp), or torch's bare AssertionError
    (optimizer_in_backward); released, refused as stepping during backward (it steps
    nothing then: 0.0198 off the plain run, which the scaler drives fine)."""
    for rank_results in two_ranks:
        _after(rank_results["after"][f"{mode} {call} {technique}"], mode)


def test_one_process_a_scaler_on_a_released_or_replaced_optimizer() -> None:
    results = compare_after(("optimizer_in_backward",))
    for key, result in results.items():
        _after(result, key.split()[0])


def test_one_process_a_scaler_on_a_released_optimizer_set_up_to_clip_is_the_plain_run(
        ) -> None:
    """Released, but set up with clip_grad_norm=: before (968cf42), its step() clipped
    again what the loop clipped (3.0e-8 off the plain run after 3 AdamW steps without a
    scaler), so a scaler driving it was refused. Now its step() leaves the loop's clip
    alone: bitwise the plain run, the scaler's skipped step (an inf) included."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from overlapkit.integrations.accelerate import prepare

    def run(overlapped: bool) -> list[torch.Tensor]:
        AcceleratorState._reset_state(True)
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 4))
        optimizer: Any = torch.optim.AdamW(model.parameters())
        if overlapped:
            model, optimizer = prepare(accelerator, model, optimizer,
                                       technique="optimizer_in_backward", clip_grad_norm=0.5)
        else:
            model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.backward(model(torch.randn(8, 8)).square().mean())  # the first step
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        if overlapped:
            optimizer.optimizer.release()
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(3):
            loss = model(torch.randn(8, 8)).square().mean() * (math.inf if step == 1 else 1)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        assert scaler.get_scale() == 512.0
        return [p.detach().clone() for p in model.parameters()]

    plain, got = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
