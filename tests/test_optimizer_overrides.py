"""Where users customise the optimizer overlapkit steps (plain module, 1 process; DDP, 2
gloo ranks; rank code: optimizer_overrides_ranks.py).

A subclass of ``AdamW`` overriding ``step()``: the engine ran the override once per part
stepped during backward, on part of the parameters (before: a counting override
counted 9 in 3 steps; noise added after the update 0.0095 off the plain loop after 4
steps, with ``learn_first_step`` too, silently).
Now, in a loop that learnt its first step, every step is taken at ``step()`` in the
plain order, bitwise, the override called once per step, one warning; a loop that did
not learn it is refused at its first ``step()``, naming ``learn_first_step``; a
backward-only loop runs it per part, as documented.

The adopted ``AdamW`` stepped directly (a reference kept to it): before, a second step
of the kept gradients under ``overlap_ddp`` (AdamW 0.081 off after 4 steps, silently);
now refused before it steps, and a plain optimizer again after ``release()``. Its own
``add_param_group`` (unfreezing a layer): the parameters were never stepped during
backward (0.038 off after 6 steps, silently); now the next backward is refused, nothing
stepped in it."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers import compare, each_setting, error_of, ranks_fixture, values
from optimizer_overrides_ranks import SETTINGS, STEPS, run
from torch import nn

import overlapkit

CASES = [(setting, technique) for setting, (_, techniques) in SETTINGS.items()
         for technique in techniques]
#: what each way of customising the step is called in the messages
NAMED = {"subclass": "Noisy.step() overrides Adam.step()",
         "instance patch": "a step() set on this AdamW (patched_adamw.<locals>.noisy_step) "
                           "replaces AdamW.step()"}


ranks = ranks_fixture(run)


@pytest.mark.parametrize("build", NAMED)
@pytest.mark.parametrize(("setting", "technique"), CASES)
def test_a_step_override_runs_once_per_step_in_the_plain_order_once_learnt(
        ranks: list[dict[Any, Any]], setting: str, technique: str, build: str) -> None:
    """``build``: a subclass overriding ``step()``, or ``step`` patched on the instance
    (over an LR scheduler's patch): before, the patch ran inside backward (0.0092 off
    the plain loop after 4 steps, 0.011 not learnt, silently)."""
    for results in each_setting(ranks, setting):
        found = results[setting, technique, "learnt", build]
        assert found["error"] is None and found["bitwise"], found
        assert found["calls"] == (STEPS, STEPS), found
        assert len(found["warnings"]) == 1, found["warnings"]
        assert NAMED[build] in found["warnings"][0]


@pytest.mark.parametrize("build", NAMED)
@pytest.mark.parametrize(("setting", "technique"), CASES)
def test_a_step_override_in_a_loop_not_learnt_is_refused_at_its_first_step(
        ranks: list[dict[Any, Any]], setting: str, technique: str, build: str) -> None:
    for results in each_setting(ranks, setting):
        error = results[setting, technique, "not learnt", build]["error"]
        assert error is not None and error["overlapkit"], error
        assert NAMED[build] in error["message"]
        assert "learn_first_step" in error["message"]


def test_a_backward_only_loop_runs_the_override_per_part(
        ranks: list[dict[Any, Any]]) -> None:
    found = ranks[0]["backward only"]
    assert found["error"] is None and found["calls"] >= STEPS, found


@pytest.mark.parametrize(("setting", "technique"), CASES)
def test_the_adopted_optimizers_own_step_is_refused_before_it_steps(
        ranks: list[dict[Any, Any]], setting: str, technique: str) -> None:
    for results in each_setting(ranks, setting):
        found = results[setting, technique, "adopted step()"]
        error = found["error"]
        assert error is not None and error["overlapkit"], error
        assert f"not on the optimizer {technique} returned" in error["message"]
        assert found["unchanged"], found["unchanged"]
        assert found["after release"] is None, found["after release"]


@pytest.mark.parametrize(("setting", "technique"), CASES)
def test_parameters_added_to_the_adopted_optimizer_itself_are_refused_at_the_next_backward(
        ranks: list[dict[Any, Any]], setting: str, technique: str) -> None:
    for results in each_setting(ranks, setting):
        found = results[setting, technique, "added behind"]
        error = found["error"]
        assert error is not None and error["overlapkit"], error
        assert "its own add_param_group()" in error["message"]
        assert found["unchanged"], found["unchanged"]


@pytest.mark.parametrize("build", NAMED)
def test_a_step_override_with_sharded_state_is_refused_at_set_up(
        ranks: list[dict[Any, Any]], build: str) -> None:
    """Each rank ran it on its share, per part (before: 0.015 off after 4 steps, silently)."""
    for results in ranks:
        error = results["sharded", build]["error"]
        assert error is not None and error["type"] == "UnsupportedOptimizerError", error
        assert NAMED[build] in error["message"]


def test_a_step_patched_on_the_instance_after_set_up_with_sharded_state_is_refused(
        ranks: list[dict[Any, Any]]) -> None:
    """At the next backward, on every rank, nothing stepped in it."""
    for results in ranks:
        found = results["sharded, patched later"]
        error = found["error"]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "a step() set on this AdamW" in error["message"]
        assert "Nothing was stepped in this backward" in error["message"]
        assert found["unchanged"], found["unchanged"]


def test_a_backward_only_loop_with_a_step_hook_from_its_first_backward_is_refused() -> None:
    """A step hook registered before the first backward defers the steps to ``step()``:
    a loop that never calls it stepped nothing, backward after backward (before: no
    parameter changed in 3 backwards, silently). Its second backward is refused, nothing
    stepped; registered after the first backward, the hook runs per part stepped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2)
    runs: list[int] = []
    opt.register_step_post_hook(lambda *_: runs.append(1))
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="a step hook registered"):
        model(x).pow(2).mean().backward()
    before = values(model)
    error = error_of(lambda: model(x).pow(2).mean().backward())
    assert error is not None and error["overlapkit"], error
    assert "before its first step()" in error["message"]
    assert compare(before, values(model)) and runs == []
    opt.release()


def test_a_step_patched_on_the_instance_marked_per_part_runs_per_part() -> None:
    """``patch.overlapkit_per_part = True`` (a profiler's, a counter of partial steps):
    no plain order, no warning; the patch runs where the parts are stepped, during
    backward, not at ``step()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved, parts = optimizer.step, []

    def counted(*args: Any, **kwargs: Any) -> Any:
        parts.append(1)
        return saved(*args, **kwargs)

    counted.overlapkit_per_part = True  # type: ignore[attr-defined]
    optimizer.step = counted  # type: ignore[method-assign]
    opt = overlapkit.optimizer_in_backward(model, optimizer)  # each parameter a part
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(STEPS):
            model(x).pow(2).mean().backward()
            in_backward = len(parts)
            opt.step()
            assert len(parts) == in_backward, "run at step()"
            opt.zero_grad()
    opt.release()
    assert len(parts) >= STEPS, parts
