"""The window between backward and ``step()`` in a loop that steps during backward.
Whatever the loop does there that the plain ``step()`` would have used is refused at
that ``step()`` with a ``ConfigurationError`` naming what to do, on every rank, for both
techniques (0.3 and 0.4.0: silently ignored, or a raw error): a gradient changed in
place or replaced (from the first step on), a hyperparameter changed (a hand-written
warm-up, ``lr_scheduler.step()`` before ``step()``), ``zero_grad()``. A second ``step()``
after ``optimizer_in_backward`` freed the gradients is refused before it changes
anything; torch's ``clip_grads_with_norm_`` before it touches a gradient; a second
backward through a graph kept with ``retain_graph=True`` before it reaches a parameter
(0.4.0: autograd's own error from inside it). Integrations
learn the loop at its first step instead
(tests/trainers/huggingface/test_accelerate_window.py)."""

from __future__ import annotations

import copy
import math
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import compare, learned_loop, rank_batches, stepped_once, values
from torch import nn
from window_ranks import run

import overlapkit
from overlapkit.distributed import run_distributed
from overlapkit.overlap.rules.late_clipping import FreedGradientNormWarning


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


def _refused(rank_results: dict[str, Any], key: str, at: int, words: str) -> None:
    found = rank_results[key]
    error = found["error"]
    assert error is not None and error["type"] == "ConfigurationError", found
    assert words in error["message"], error["message"]
    assert found["at"] == at, found


def test_gradients_changed_before_the_first_step_are_refused_at_it(
        two_ranks: list[dict[str, Any]]) -> None:
    # 0.4.0 marked the gradients only once the loop had called step(): 0.0064 off
    for rank_results in two_ranks:
        _refused(rank_results, "overlap_ddp first gradients halved", 0,
                 "were changed between backward() and optimizer.step()")


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize(("window", "at"), [("warm-up", 0), ("scheduler first", 0)])
def test_a_learning_rate_changed_before_step_is_refused_at_that_step(
        two_ranks: list[dict[str, Any]], technique: str, window: str, at: int) -> None:
    # the plain step() uses the new lr; 0.4.0 had stepped with the old one, silently
    # (0.015 off after 3 steps of a warm-up)
    for rank_results in two_ranks:
        _refused(rank_results, f"{technique} {window}", at,
                 "the optimizer's settings (lr of param group 0) were changed")
        message = rank_results[f"{technique} {window}"]["error"]["message"]
        assert "optimizer.learn_first_step(model)" in message
        assert "lr_scheduler.step() called before optimizer.step()" in message


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_a_parameter_changed_in_place_before_step_is_refused_at_that_step(
        two_ranks: list[dict[str, Any]], technique: str) -> None:
    # the plain step() starts from the clamped values (0.4.0: 0.055 off after 3 Adam steps,
    # silently)
    for rank_results in two_ranks:
        _refused(rank_results, f"{technique} parameters clamped", 0, "changed in place")


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize(("window", "name"), [("momentum scaled", "module.0.weight"),
                                              ("state entry cleared", "module.2.bias")])
def test_optimizer_state_written_before_step_is_refused_at_that_step(
        two_ranks: list[dict[str, Any]], technique: str, window: str, name: str) -> None:
    # the plain step() starts from the written state (0.4.0: not detected, AdamW 0.0064
    # off after 4 steps)
    for rank_results in two_ranks:
        _refused(rank_results, f"{technique} {window}", 1,
                 f"the optimizer's state of {name}")
        assert "was written between backward()" in rank_results[
            f"{technique} {window}"]["error"]["message"]


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_zero_grad_between_backward_and_step_is_refused_at_step(
        two_ranks: list[dict[str, Any]], technique: str) -> None:
    # the plain step() steps nothing after it (0.4.0: a step taken, silently)
    for rank_results in two_ranks:
        _refused(rank_results, f"{technique} zero_grad", 0,
                 "zero_grad() was called after a backward that stepped the parameters")


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_a_skipped_step_is_refused_at_its_zero_grad_clearing_nothing(
        two_ranks: list[dict[str, Any]], technique: str) -> None:
    # backward, zero_grad(), no step() (a loop skipping a step on a non-finite norm):
    # the plain loop takes no step there (0.4.0: stepped silently, 0.017 off)
    for rank_results in two_ranks:
        found = rank_results[f"{technique} skipped step"]
        _refused(rank_results, f"{technique} skipped step", 1,
                 "zero_grad() was called after a backward that stepped the parameters")
        assert found["unchanged by it"], found


def test_a_second_step_after_freed_gradients_is_refused_before_it_changes_anything(
        two_ranks: list[dict[str, Any]]) -> None:
    for rank_results in two_ranks:
        found = rank_results["optimizer_in_backward step twice"]
        _refused(rank_results, "optimizer_in_backward step twice", 0,
                 "optimizer.step() was called again")
        assert found["unchanged by it"], found


def test_a_second_step_with_kept_gradients_is_bitwise_the_plain_loop(
        two_ranks: list[dict[str, Any]]) -> None:
    # overlap_ddp keeps the stepped gradients: the second step() steps them again
    for rank_results in two_ranks:
        found = rank_results["overlap_ddp step twice"]
        assert found["bitwise plain"], found


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_clip_grads_with_norm_after_a_stepping_backward_is_refused_before_it_clips(
        two_ranks: list[dict[str, Any]], technique: str) -> None:
    # 0.4.0: overlap_ddp refused only at step(), the gradients clipped;
    # optimizer_in_backward: torch's AttributeError from inside get_total_norm
    for rank_results in two_ranks:
        found = rank_results[f"{technique} clip in two halves"]
        _refused(rank_results, f"{technique} clip in two halves", 0,
                 "clip_grads_with_norm_(..., max_norm=0.05) was called after a backward")
        assert found["unchanged by it"], found


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_a_loop_told_to_learn_its_first_step_keeps_gradient_noise_bitwise_with_one_warning(
        two_ranks: list[dict[str, Any]], technique: str) -> None:
    # the way out the refusals name: optimizer.learn_first_step(model) before the loop
    for rank_results in two_ranks:
        found = rank_results[f"{technique} learned"]
        assert found["bitwise plain"], found
        assert len(found["warnings"]) == 1, found["warnings"]
        assert "in the plain order" in found["warnings"][0]


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_an_ema_updated_in_a_learned_first_window_keeps_the_plain_order_bitwise(
        two_ranks: list[dict[str, Any]], technique: str) -> None:
    # AveragedModel.update_parameters between backward and step() (tests/test_window_params.py)
    for rank_results in two_ranks:
        found = rank_results[f"{technique} learned ema"]
        assert found["bitwise plain"], found
        assert len(found["warnings"]) == 1, found["warnings"]
        assert "the values of module.0.weight" in found["warnings"][0]


def test_sharded_parameters_read_in_the_window_are_warned_of_the_exchange_is_not(
        two_ranks: list[dict[str, Any]]) -> None:
    # the exchange landing the other ranks' updates after backward once read as the
    # loop's read on rank 0 (a false ParameterReadInWindowWarning)
    for rank_results in two_ranks:
        found = rank_results["sharded reads"]
        assert found[False] == [], found
        assert found[True] == ["ParameterReadInWindowWarning"], found


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_a_second_backward_through_a_kept_graph_is_refused_before_it_reaches_a_parameter(
        two_ranks: list[dict[str, Any]], technique: str) -> None:
    # 0.4.0: autograd's RuntimeError ("modified by an inplace operation") from inside it
    for rank_results in two_ranks:
        found = rank_results[f"{technique} backward twice"]
        error = found["error"]
        assert error is not None and error["type"] == "ConfigurationError", found
        assert "through a graph kept with retain_graph=True" in error["message"]
        assert "inside `with ddp_model.no_sync():`" in error["message"]
        assert found["unchanged by it"], found


def test_a_plain_module_refuses_a_second_backward_through_a_kept_graph() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    overlapkit.optimizer_in_backward(module, torch.optim.SGD, lr=1e-2, momentum=0.9)
    loss = module(rank_batches(0, 1)[0]).square().mean()
    loss.backward(retain_graph=True)
    before = values(module)
    with pytest.raises(overlapkit.ConfigurationError, match=r"optimizer\.no_step"):
        (0.5 * loss).backward()
    assert compare(before, values(module))


def test_get_total_norm_of_freed_gradients_is_nan_with_a_warning() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=1e-2)
    module(rank_batches(0, 1)[0]).square().mean().backward()
    for grads in ([p.grad for p in module.parameters()],
                  [p.grad for p in module.parameters() if p.grad is not None]):
        with pytest.warns(FreedGradientNormWarning, match="freed during backward"):
            assert math.isnan(float(torch.nn.utils.get_total_norm(grads)))


@pytest.mark.parametrize("optim", [torch.optim.Adam, torch.optim.AdamW])
def test_a_plain_module_refuses_a_warm_up_and_a_second_step_too(optim: Any) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = overlapkit.optimizer_in_backward(module, optim, lr=1e-2)
    batches = rank_batches(0, 2)
    module(batches[0]).square().mean().backward()
    opt.param_groups[0]["betas"] = (0.8, 0.99)
    with pytest.raises(overlapkit.ConfigurationError, match="betas of param group 0"):
        opt.step()
    opt.zero_grad()
    module(batches[1]).square().mean().backward()
    opt.step()
    before = values(module)
    with pytest.raises(overlapkit.ConfigurationError, match="called again"):
        opt.step()
    assert compare(before, values(module))


@pytest.mark.parametrize("copy_it", [copy.deepcopy, pickle.dumps])
def test_copying_or_pickling_the_optimizer_is_refused_naming_the_state_dict(
        copy_it: Any) -> None:
    # 0.4.0: a bare TypeError (not an OverlapkitError); a plain optimizer copies
    module = nn.Sequential(nn.Linear(4, 2))
    opt = overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=1e-2)
    with pytest.raises(overlapkit.NotPicklableError, match=r"opt\.state_dict\(\)") as info:
        copy_it(opt)
    assert isinstance(info.value, TypeError)
    copy.deepcopy(opt.state_dict())  # what the message says works


def test_load_state_dict_between_backward_and_step_is_refused_loading_nothing() -> None:
    # the plain step() steps from the loaded state (0.4.0: 0.018 off, silently)
    _, opt = stepped_once()
    saved = copy.deepcopy(opt.state_dict())
    with pytest.raises(overlapkit.ConfigurationError, match="Nothing was loaded"):
        opt.load_state_dict({**saved, "state": {}})
    assert compare(saved["state"][0], opt.state_dict()["state"][0])
    opt.step()
    opt.zero_grad()
    opt.load_state_dict(saved)  # after step(): the plain loop's


def test_load_state_dict_in_the_first_window_is_refused_loading_nothing() -> None:
    # whether the loop calls step() is not known yet: 0.4.0 loaded (lr and state
    # replaced), then refused the step() that followed, after the load
    _, opt = stepped_once()
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["lr"] = 5.0
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    fresh = overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=1e-2)
    module(rank_batches(0, 1)[0]).square().mean().backward()
    before = copy.deepcopy(fresh.state_dict())
    with pytest.raises(overlapkit.ConfigurationError, match="first stepping backward"):
        fresh.load_state_dict(saved)
    after = fresh.state_dict()
    assert after["param_groups"][0]["lr"] == 1e-2
    assert compare(before["state"][0], after["state"][0])
    fresh.step()
    fresh.zero_grad()
    fresh.load_state_dict(saved)  # after step(): the plain loop's


def test_a_param_group_added_between_backward_and_step_is_refused_at_step() -> None:
    # the plain step() steps the added parameters with this backward's gradients
    module, opt = stepped_once(lambda m: list(m[0].parameters()))
    opt.add_param_group({"params": list(module[2].parameters())})
    with pytest.raises(overlapkit.ConfigurationError, match=r"settings \(param groups\)"):
        opt.step()


def _learned_is_plain(iteration: Callable[[nn.Module, Any, int, torch.Tensor], None],
                      steps: int) -> list[str]:
    """The warnings of the learnt loop, once its values are bitwise the plain loop's."""
    expected, _ = learned_loop(False, iteration, steps)
    ours, said = learned_loop(True, iteration, steps)
    assert compare(expected, ours)
    return said


def test_a_warm_up_seen_in_a_learned_first_step_keeps_the_plain_order_bitwise() -> None:
    # the integrations' learn_first_step (Accelerate): a warm-up written before step()
    # is seen before anything steps, and every step is taken at step() with the new lr
    def warm_up(module: nn.Module, opt: Any, i: int, batch: torch.Tensor) -> None:
        module(batch).square().mean().backward()
        opt.param_groups[0]["lr"] = 1e-2 * (i + 1) / 4
        opt.step()
        opt.zero_grad()

    said = _learned_is_plain(warm_up, 4)
    assert len(said) == 1 and "settings (lr of param group 0) were changed" in said[0]


def test_a_parameter_clamped_in_a_learned_first_step_keeps_the_plain_order_bitwise() -> None:
    def clamp(module: nn.Module, opt: Any, i: int, batch: torch.Tensor) -> None:
        module(batch).square().mean().backward()
        with torch.no_grad():
            module[0].weight.clamp_(-0.1, 0.1)
        opt.step()
        opt.zero_grad()

    said = _learned_is_plain(clamp, 3)
    assert len(said) == 1 and "were changed in place" in said[0], said


def test_a_learned_loop_that_never_zeroes_gradients_keeps_the_plain_order_bitwise() -> None:
    # optimizer_in_backward frees each gradient once stepped; this loop adds every
    # backward to the last gradients (0.4.0: 0.0128 off after 4 steps, silently)
    def never_zero(module: nn.Module, opt: Any, i: int, batch: torch.Tensor) -> None:
        module(batch).square().mean().backward()
        opt.step()

    said = _learned_is_plain(never_zero, 4)
    assert len(said) == 1 and "no zero_grad() came between optimizer.step()" in said[0], said


@pytest.mark.parametrize("zero", ["optimizer", "model", "set to None", "before backward"])
def test_a_learned_loop_that_zeroes_gradients_keeps_the_overlap(zero: str) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=1e-2)
    opt.learn_first_step(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, batch in enumerate(rank_batches(0, 3)):
            if zero == "before backward":
                opt.zero_grad()
            versions = [p._version for p in module.parameters()]
            module(batch).square().mean().backward()
            assert (versions != [p._version for p in module.parameters()]) == (i > 0)
            opt.step()
            if zero == "optimizer":
                opt.zero_grad()
            elif zero == "model":
                module.zero_grad()
            elif zero == "set to None":
                for param in module.parameters():
                    param.grad = None
