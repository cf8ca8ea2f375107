"""A clip of the parameters that have a gradient (``[p for p in params if p.grad is not
None]``, ``filter(...)``) between backward and ``step()`` under ``optimizer_in_backward``:
the gradients were freed once stepped, so the list is empty. 0.4.0 handed the empty list
to torch: ``clip_grad_norm_`` clipped nothing and returned 0 (SGD 0.056 off the plain loop
after 4 steps, silently), ``get_total_norm`` then ``clip_grads_with_norm_`` the same
(warned of only as a NaN norm), ``clip_grad_value_`` raised torch's own
``RuntimeError`` from inside it. Now the empty list stands for the parameters the
backward freed (``overlapkit/overlap/rules/clip_halves.py``): the clip the optimizer
applied (``clip_grad_norm=``, ``clip_grad_value=``) is answered, bitwise the plain loop,
its norm returned; another is a ``ConfigurationError`` at the call."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import compare, rank_batches, values
from torch import nn

import overlapkit

MAX_NORM, CLIP_VALUE = 0.05, 1e-3


def _with_grads(module: nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.grad is not None]


def _norm(module: nn.Module) -> Any:
    return torch.nn.utils.clip_grad_norm_(_with_grads(module), MAX_NORM)


def _norm_of_filter(module: nn.Module) -> Any:
    return torch.nn.utils.clip_grad_norm_(
        filter(lambda p: p.grad is not None, module.parameters()), MAX_NORM)


def _halves(module: nn.Module) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optimizer_in_backward: a NaN norm, warned of
        total = torch.nn.utils.get_total_norm([p.grad for p in _with_grads(module)])
    torch.nn.utils.clip_grads_with_norm_(_with_grads(module), MAX_NORM, total)
    return None


def _value(module: nn.Module) -> Any:
    torch.nn.utils.clip_grad_value_(_with_grads(module), CLIP_VALUE)
    return None


def _train(overlapped: bool, clip: Callable[[nn.Module], Any],
           **options: Any) -> tuple[list[torch.Tensor], list[Any]]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt: Any = (overlapkit.optimizer_in_backward(module, torch.optim.SGD, lr=0.1,
                                                 momentum=0.9, **options) if overlapped
                else torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    returned = []
    for batch in rank_batches(0, 4):
        module(batch).square().mean().backward()
        returned.append(clip(module))
        opt.step()
        opt.zero_grad()
    return values(module), returned


@pytest.mark.parametrize("clip", [_norm, _norm_of_filter, _halves, _value],
                         ids=["clip_grad_norm_", "filter", "clip_grads_with_norm_",
                              "clip_grad_value_"])
def test_a_clip_of_the_freed_parameters_not_set_up_is_refused_at_the_call(
        clip: Callable[[nn.Module], Any]) -> None:
    # before: torch's clip of nothing (0.056 off after 4 steps), or, by value, torch's
    # RuntimeError from inside it
    with pytest.raises(overlapkit.ConfigurationError,
                       match="had already stepped these parameters"):
        _train(True, clip)


@pytest.mark.parametrize(("clip", "options"), [
    (_norm, {"clip_grad_norm": MAX_NORM}), (_norm_of_filter, {"clip_grad_norm": MAX_NORM}),
    (_halves, {"clip_grad_norm": MAX_NORM}), (_value, {"clip_grad_value": CLIP_VALUE})],
    ids=["clip_grad_norm_", "filter", "clip_grads_with_norm_", "clip_grad_value_"])
def test_the_clip_the_optimizer_applied_is_answered_bitwise_the_plain_loop(
        clip: Callable[[nn.Module], Any], options: dict[str, Any]) -> None:
    # before (by norm): the norm returned was 0, the plain loop's 0.41
    expected, expected_returned = _train(False, clip)
    ours, returned = _train(True, clip, **options)
    assert compare(expected, ours)
    if clip in (_norm, _norm_of_filter):
        assert compare(expected_returned, returned)
        assert all(float(norm) > MAX_NORM for norm in returned)  # clipping was active


def test_an_empty_list_after_step_is_torchs() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 4))
    opt = overlapkit.optimizer_in_backward(module, torch.optim.SGD, lr=0.1)
    module(rank_batches(0, 1)[0]).sum().backward()
    opt.step()  # the window is over: nothing to stand for
    assert float(torch.nn.utils.clip_grad_norm_(_with_grads(module), MAX_NORM)) == 0.0
    assert not math.isnan(float(torch.nn.utils.clip_grad_norm_([], math.inf)))
