"""The parameters read between backward and ``step()`` (an EMA's ``update_parameters``, a
copy of the model, a logged weight norm) in a loop that learns its first step
(``learn_first_step``, as Accelerate's ``prepare`` does): the plain loop reads the last
step's values there, a step taken during backward would have them hold this step's.
Seen in the first window: every step stays at ``step()``, bitwise the plain loop, one
warning; a loop that reads them elsewhere keeps the overlap. A loop that does not learn
its first step is warned of such a read once (``ParameterReadInWindowWarning``).
(``overlapkit/overlap/core/watched_params.py``; ``overlap_ddp`` on 2 ranks:
``tests/window_ranks.py``.)"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import compare, learned_loop, rank_batches, values
from torch import nn

import overlapkit
from overlapkit.overlap.core.watched_params import (
    FreedGradientReadWarning,
    ParameterReadInWindowWarning,
)


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _train(overlap: bool, in_window: Callable[[nn.Module, dict[str, Any]], None],
           steps: int = 4) -> tuple[list[torch.Tensor], dict[str, Any], list[str]]:
    """``steps`` steps of AdamW, ``in_window(module, kept)`` between backward and
    ``step()``; the model's values, what ``in_window`` kept, the warnings."""
    kept: dict[str, Any] = {}
    modules: list[nn.Module] = []

    def iteration(module: nn.Module, opt: Any, i: int, batch: torch.Tensor) -> None:
        modules[:] = [module]
        module(batch).square().mean().backward()
        in_window(module, kept)
        opt.step()
        opt.zero_grad()

    found, said = learned_loop(overlap, iteration, steps)
    assert all(type(p) is nn.Parameter for p in modules[0].parameters())  # given back
    return found, kept, said


def _ema(module: nn.Module, kept: dict[str, Any]) -> None:
    ema = kept.setdefault("ema", torch.optim.swa_utils.AveragedModel(module))
    ema.update_parameters(module)


def _weight_norms(module: nn.Module, kept: dict[str, Any]) -> None:
    kept.setdefault("norms", []).append([p.norm().item() for p in module.parameters()])


def _lazy_copy(module: nn.Module, kept: dict[str, Any]) -> None:
    """An EMA built as a deep copy at the first step, updated by hand."""
    if "copy" not in kept:
        kept["copy"] = copy.deepcopy(module)
    with torch.no_grad():
        for mine, theirs in zip(kept["copy"].parameters(), module.parameters(), strict=True):
            mine.lerp_(theirs.data, 0.1)


@pytest.mark.parametrize("in_window", [_ema, _weight_norms, _lazy_copy],
                         ids=["AveragedModel.update_parameters", "weight norms", "deepcopy"])
def test_parameters_read_in_a_learned_first_window_keep_the_plain_order_bitwise(
        in_window: Callable[[nn.Module, dict[str, Any]], None]) -> None:
    # before: 0.0074 off the plain EMA after 4 steps (AveragedModel), silently
    expected, expected_kept, _ = _train(False, in_window)
    ours, ours_kept, said = _train(True, in_window)
    assert compare(expected, ours)
    for name, value in expected_kept.items():
        if name == "norms":
            assert ours_kept[name] == value
        else:
            assert compare(values(value), values(ours_kept[name]))
            assert all(type(p) is nn.Parameter for p in ours_kept[name].parameters())
    assert len(said) == 1, said
    assert "the values of 0.weight, 0.bias, 2.weight and others were read" in said[0]
    assert "read them after optimizer.step()" in said[0]


def _log_after_the_step_only(module: nn.Module, kept: dict[str, Any]) -> None:
    """What reads no values: shapes, a hook registered and removed."""
    kept["shapes"] = [tuple(p.shape) for p in module.parameters()]
    for param in module.parameters():
        param.register_hook(lambda grad: grad).remove()


def test_a_loop_reading_no_parameter_values_in_the_window_keeps_the_overlap() -> None:
    module = _module()
    opt = overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=1e-2)
    opt.learn_first_step(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, batch in enumerate(rank_batches(0, 3)):
            before = [p._version for p in module.parameters()]  # not a read of values
            with opt.no_step():  # accumulation: the next forward reads the parameters
                module(batch).square().mean().backward()
            module(batch).square().mean().backward()
            stepped = before != [p._version for p in module.parameters()]
            assert stepped == (i > 0)  # from the second step on: during backward
            _log_after_the_step_only(module, {})
            opt.step()
            opt.zero_grad()
            _weight_norms(module, {})  # after step(): the same values in both loops


def _unlearnt(in_window: Callable[[nn.Module], None]) -> list[warnings.WarningMessage]:
    """Four steps of a loop that does not learn its first step (it steps during backward
    from the first), ``in_window(module)`` between backward and ``step()``."""
    module = _module()
    opt = overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in rank_batches(0, 4):
            module(batch).square().mean().backward()
            in_window(module)
            opt.step()
            opt.zero_grad()
            _weight_norms(module, {})  # after step(): not in the window
    assert all(type(p) is nn.Parameter for p in module.parameters())
    return list(caught)


def test_parameters_read_after_a_stepping_backward_are_warned_of_once() -> None:
    # before: not detected, the EMA one step ahead of the plain loop's, silently
    average = torch.optim.swa_utils.AveragedModel(_module())
    caught = _unlearnt(average.update_parameters)
    assert [w.category for w in caught] == [ParameterReadInWindowWarning], caught
    assert "parameters read between backward() and optimizer.step()" in str(caught[0].message)
    assert caught[0].filename == __file__  # the loop's line, past torch's swa_utils


def test_copies_taken_in_the_window_are_plain_parameters() -> None:
    copies: list[nn.Module] = []
    caught = _unlearnt(lambda module: copies.append(copy.deepcopy(module)))
    assert len(caught) == 1
    assert all(type(p) is nn.Parameter for c in copies for p in c.parameters())


def test_a_loop_reading_parameters_only_after_step_is_not_warned() -> None:
    def no_values(module: nn.Module) -> None:
        _log_after_the_step_only(module, {})
        assert all(p.grad is None for p in module.parameters())  # .grad: not a value read
    # the freed gradients read (None): tests/test_window_freed_grads.py
    assert [w for w in _unlearnt(no_values)
            if w.category is not FreedGradientReadWarning] == []
