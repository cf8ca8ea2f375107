"""``overlapkit.integrations.accelerate.prepare`` in loops that work in the window
between backward and ``optimizer.step()`` (issue 30, cases 5 and 6). 0.3: Accelerate's
manual accumulation got a ``ConfigurationError`` at ``step()`` after 2 steps were taken;
gradient noise was silently ignored by ``overlap_ddp`` on 2 ranks (0.036-0.049 off) and
gave a raw ``AttributeError`` under ``optimizer_in_backward`` after a step. Now the first
step is deferred to learn the loop (``overlapkit.overlap.core.window``), and such a loop
takes every step in the plain order: bitwise the plain Accelerate run (parameters,
optimizer state, clip norms), with one warning, on one process and on 2 gloo ranks,
with both techniques.
0.4's probe found, each now the same: a warm-up written by hand (the learning rate set
between backward and step: 0.0117 off), Adam's moments logged there and the norm
asked again after the clip (other values logged). A later learning-rate change in that
window now raises at that ``step()`` (before: silently 0.0044 off); a
``clip_grad_value_`` or a clip over two optimizers' parameters the optimizer was not
set up for is refused at the first clip, before anything steps (before: after the
first step). The eighth probe: a forward past the DDP wrapper
(``accelerator.unwrap_model(model)(**batch)``) is refused as ``accelerator.backward``
starts, nothing stepped (before: ``overlap_ddp`` silently 0.00038 off after 4 steps on 2
ranks, ``optimizer_in_backward`` refused naming ``find_unused_parameters``)."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from accelerate_window_runs import (
    CASES,
    MAX_NORM,
    ZEROS,
    checkpoint_in_the_window,
    checkpoints,
    compare_case,
    gans,
    norm_after_the_clip,
    refused_in_the_window,
    run,
    second_backward,
)
from trainer_helpers import check_plain_order

from overlapkit.distributed import run_distributed

pytestmark = pytest.mark.trainers

NAMED = {"manual accumulation": "2 backwards ran before one optimizer.step()",
         "gradient noise": "were changed", "gradient masking": "were changed",
         "gradient norms logged": "were read",
         "warm-up by hand": "settings (lr of param group 0) were changed",
         "optimizer state logged": "the optimizer's state was read",
         "norm logged after the clip": "clip_grad_norm_ was called again after",
         "clip of part of the model": "clip_grad_norm_ left out"}


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    return {case: compare_case(case, ("optimizer_in_backward",)) for case in CASES}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=600)


@pytest.fixture(scope="module")
def one_launched_process() -> dict[str, Any]:
    """One process launched as torchrun launches it: Accelerate wraps the model in DDP
    (of one rank), so overlap_ddp runs too."""
    (result,) = run_distributed(run, 1, timeout=600)
    return result


@pytest.mark.parametrize("case", CASES)
def test_one_process_a_loop_using_the_window_is_bitwise_the_plain_run_with_one_warning(
        one_process: dict[str, Any], case: str) -> None:
    check_plain_order(one_process[case]["optimizer_in_backward"], NAMED[case])


@pytest.mark.parametrize("case", CASES)
def test_one_launched_process_overlap_ddp_using_the_window_is_bitwise_the_plain_run(
        one_launched_process: dict[str, Any], case: str) -> None:
    check_plain_order(one_launched_process[case]["overlap_ddp"], NAMED[case])


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_a_loop_using_the_window_is_bitwise_the_plain_run_with_one_warning(
        two_ranks: list[dict[str, Any]], case: str, technique: str) -> None:
    for rank_results in two_ranks:
        check_plain_order(rank_results[case][technique], NAMED[case])


def _refused_second_backward(result: dict[str, Any]) -> None:
    error = result["error"]
    assert error is not None and error["type"] == "ConfigurationError", error
    assert "backward() ran again before optimizer.step()" in error["message"]
    assert "Nothing was stepped in this backward" in error["message"]
    assert "accelerator.accumulate" in error["message"], error["message"]
    assert result["unchanged"], result["unchanged"]


def test_one_process_a_second_backward_in_a_later_step_is_refused_stepping_nothing() -> None:
    """After the first step has shown the loop calls step(), a second backward before
    step() (an auxiliary loss) is refused, naming what to do; it steps nothing."""
    _refused_second_backward(second_backward("optimizer_in_backward"))


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_two_ranks_a_second_backward_in_a_later_step_is_refused_stepping_nothing(
        two_ranks: list[dict[str, Any]], technique: str) -> None:
    for rank_results in two_ranks:
        _refused_second_backward(rank_results["second backward"][technique])


def test_a_learning_rate_changed_in_the_window_after_the_overlap_began_raises_at_step() -> None:
    """The third step's backward has stepped with the old learning rate: never silently."""
    result = refused_in_the_window("late learning rate", "optimizer_in_backward")
    error = result["error"]
    assert error is not None and error["type"] == "ConfigurationError", error
    assert result["step"] == 3
    assert "lr of param group 0" in error["message"]
    assert "missed this step" in error["message"]


@pytest.mark.parametrize(("case", "named"), [
    ("clip by value", r"clip_grad_value_\(\.\.\., clip_value=0\.05\).*clip_grad_value=0\.05"),
    ("clip over two optimizers", r"4 parameters with gradients that this .* does not step"),
    # the sixth probe: set up with clip_grad_norm= by a loop that does not clip before
    # step(): clipped every step, silently (0.0103 off the plain loop after 4 steps)
    ("no clip", r"set up with clip_grad_norm=1 \(the loop's clip\), but the loop called no"),
    ("clip after the step", r"clip_grad_norm=None if the loop does not clip"),
])
def test_a_clip_the_optimizer_was_not_set_up_for_is_refused_before_anything_steps(
        case: str, named: str) -> None:
    result = refused_in_the_window(case, "optimizer_in_backward")
    error = result["error"]
    assert error is not None and error["type"] == "ConfigurationError", error
    assert re.search(named, error["message"]), error["message"]
    assert "Nothing has stepped yet" in error["message"]
    assert result["step"] == 1 and result["unchanged"]


def _gan_checked(result: dict[str, Any], technique: str) -> None:
    same, warned, _ = result["generator first"]
    assert same
    assert len(warned) == 1 and "zero_grad() discarded the gradients" in warned[0], warned
    same, warned, error = result["discriminator first"]
    if technique == "optimizer_in_backward":
        # the discriminator's first step, learnt, kept its gradients; the generator's
        # backward adds to them, before any zero_grad(): seen as it starts, before it
        # steps: the plain order from there, bitwise
        assert same, error
        assert len(warned) == 1 and "no zero_grad() came between" in warned[0], warned
        return
    assert error is not None and error["type"] == "ConfigurationError", error
    assert "zero_grad() was called after a backward that stepped" in error["message"]
    assert "requires_grad_(False)" in error["message"]


def test_one_process_a_gan_whose_generator_loss_reaches_the_discriminator_is_never_silent(
        ) -> None:
    """Generator first: its backward reaches the discriminator before that one's first
    step, learnt then: plain order, bitwise, one warning. PyTorch's DCGAN order
    (discriminator first): its first window is clean; the generator's backward then
    adds to the gradients its learnt first step kept, seen as it starts: plain order,
    bitwise, one warning (under overlap_ddp, which keeps every gradient, it steps the
    discriminator, and the zero_grad() discarding those gradients raises, naming the
    fix). 0.4 before the probe: the discriminator took an extra step per iteration,
    silently (0.069 off after 4 iterations)."""
    _gan_checked(gans(("optimizer_in_backward",))["optimizer_in_backward"],
                 "optimizer_in_backward")


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_two_ranks_a_gan_whose_generator_loss_reaches_the_discriminator_is_never_silent(
        two_ranks: list[dict[str, Any]], technique: str) -> None:
    for rank_results in two_ranks:
        _gan_checked(rank_results["gan"][technique], technique)


def test_the_norm_asked_after_the_clip_once_overlapping_is_never_the_unclipped_one() -> None:
    """Before the probe: the norm before the clip, silently (plain: the clipped
    gradients', about 1.0). optimizer_in_backward has freed them: NaN, with a warning."""
    plain = norm_after_the_clip(None)["norms"]
    ours = norm_after_the_clip("optimizer_in_backward")
    assert all(norm <= MAX_NORM for norm in plain), plain
    assert all(math.isnan(norm) for norm in ours["norms"]), ours["norms"]
    assert any("freed during backward" in w for w in ours["warnings"]), ours["warnings"]


def _checkpoint_refused(result: dict[str, Any], call: str) -> None:
    error = result["error"]
    assert error is not None and error["type"] == "ConfigurationError", error
    assert f"accelerator.{call}() refused" in error["message"], error["message"]
    assert "Call it before the forward or after optimizer.step()" in error["message"]
    assert result["unchanged"]


def test_save_and_load_state_in_a_later_window_are_refused_before_anything_changes(
        tmp_path: Any) -> None:
    """Between a stepping backward and step(), the plain loop's save keeps the parameters
    before the step and its load gives the step its start. Before the sixth probe:
    save_state kept this step, silently (the model 0.0101 off the plain loop's
    checkpoint, Adam's moments 0.0056), and load_state loaded the model, then the
    optimizer refused its part (the parameters 0.0201 changed, training on refused)."""
    checkpoint_in_the_window("make", None, 0, f"{tmp_path}/made")
    save = checkpoint_in_the_window("save", "optimizer_in_backward", 3, f"{tmp_path}/saved")
    _checkpoint_refused(save, "save_state")
    assert "Nothing was written" in save["error"]["message"]
    assert not (tmp_path / "saved").exists()
    load = checkpoint_in_the_window("load", "optimizer_in_backward", 3, f"{tmp_path}/made")
    _checkpoint_refused(load, "load_state")
    assert "Nothing was loaded" in load["error"]["message"]


@pytest.mark.parametrize("call", ["save", "load"])
def test_save_and_load_state_in_the_first_window_are_the_plain_loops(
        tmp_path: Any, call: str) -> None:
    """The first step is deferred (nothing has stepped in its window): the save there is
    the plain loop's checkpoint, the load there its start, bitwise."""
    from helpers import compare

    checkpoint_in_the_window("make", None, 0, f"{tmp_path}/made")
    where = f"{tmp_path}/made" if call == "load" else f"{tmp_path}/{{}}"
    plain = checkpoint_in_the_window(call, None, 1, where.format("plain"))
    ours = checkpoint_in_the_window(call, "optimizer_in_backward", 1, where.format("ours"))
    assert plain["error"] is None and ours["error"] is None, ours["error"]
    assert compare(plain["params"], ours["params"])
    if call == "save":
        assert compare(_saved(tmp_path / "plain"), _saved(tmp_path / "ours"))


def _saved(directory: Any) -> dict[str, Any]:
    """The model and the optimizer state save_state wrote."""
    import torch
    from safetensors.torch import load_file

    tensors = dict(load_file(str(directory / "model.safetensors")))
    state = torch.load(directory / "optimizer.bin", weights_only=False)["state"]
    tensors.update({f"state {index} {name}": value for index, entry in state.items()
                    for name, value in entry.items() if isinstance(value, torch.Tensor)})
    return tensors


def test_two_ranks_save_and_load_state_in_a_later_window_are_refused(tmp_path: Any) -> None:
    for rank_results in run_distributed(checkpoints, 2, args=(str(tmp_path),), timeout=600):
        for technique in ("overlap_ddp", "optimizer_in_backward"):
            _checkpoint_refused(rank_results[technique]["save"], "save_state")
            assert not rank_results[technique]["save"]["wrote"]
            _checkpoint_refused(rank_results[technique]["load"], "load_state")


def test_one_process_zero_grad_keeping_zeros_is_the_plain_loop_with_one_warning() -> None:
    """``zero_grad(set_to_none=False)`` keeps a zero gradient per parameter, which
    optimizer_in_backward frees. Before the sixth probe: refused at the third step's
    zero_grad, after two steps (the run stopped)."""
    check_plain_order(compare_case(ZEROS, ("optimizer_in_backward",))["optimizer_in_backward"],
                      "zero_grad(set_to_none=False) keeps a zero gradient")


def test_two_ranks_zero_grad_keeping_zeros_is_the_plain_loop(
        two_ranks: list[dict[str, Any]]) -> None:
    for rank_results in two_ranks:
        check_plain_order(rank_results[ZEROS]["optimizer_in_backward"],
                          "zero_grad(set_to_none=False) keeps a zero gradient")
        same, differences, warned = rank_results[ZEROS]["overlap_ddp"]
        assert same, differences
        assert warned == [], warned  # overlap_ddp keeps the gradients: the overlap stays


def _refused_forward_past_ddp(result: dict[str, Any]) -> None:
    error = result["error"]
    assert error is not None and error["overlapkit"], error
    assert "forward ran past DistributedDataParallel" in error["message"], error
    assert "Nothing was stepped" in error["message"], error
    assert result["step"] == 1 and result["unchanged"], result


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_two_ranks_a_forward_past_ddp_is_refused_before_anything_steps(
        two_ranks: list[dict[str, Any]], technique: str) -> None:
    for rank_results in two_ranks:
        _refused_forward_past_ddp(rank_results["forward past DDP"][technique])


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_one_launched_process_a_forward_past_ddp_is_refused_before_anything_steps(
        one_launched_process: dict[str, Any], technique: str) -> None:
    _refused_forward_past_ddp(one_launched_process["forward past DDP"][technique])


def test_one_process_a_forward_through_unwrap_model_is_the_plain_loop() -> None:
    """Without DDP (one process not launched) the unwrapped model is the model: no
    refusal (clipped with the loop's norm: the plain run's)."""
    result = refused_in_the_window("forward past DDP", "optimizer_in_backward")
    assert result["error"] is None, result
