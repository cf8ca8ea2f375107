"""Gradient accumulation written for a plain optimizer — several backwards, then one
``step()`` — without ``no_sync()`` / ``no_step()`` would take one optimizer step per
backward with an overlapped optimizer, where the plain loop takes one (0.033 off plain
DDP after 4 backwards in 0.1). It is never silent: the first ``step()`` that ends such a
window raises, on every rank, and once the loop has shown that it calls ``step()``, a
second stepping backward before it is refused before anything steps. Loops that never
call ``step()`` (the backward-only convention) are never refused
(tests/test_loop_shapes.py trains them bitwise).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers import compare, values
from step_accounting_ranks import SETUPS, run
from torch import nn

import overlapkit
from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=300)


@pytest.mark.parametrize("setup", SETUPS)
def test_a_second_backward_in_a_loop_that_calls_step_is_refused_on_every_rank(
        results: list[dict[str, Any]], setup: str) -> None:
    for rank_results in results:
        result = rank_results[setup]["refused"]
        error = result["error"]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "no_sync()" in error["message"] and "before optimizer.step()" in error["message"]
        assert result["unchanged"], result["unchanged"]  # nothing stepped in it
        assert result["moved after"]


@pytest.mark.parametrize("setup", SETUPS)
def test_accumulation_in_the_first_window_raises_at_its_step_on_every_rank(
        results: list[dict[str, Any]], setup: str) -> None:
    for rank_results in results:
        error = rank_results[setup]["first window"]["error"]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "after 2 backwards" in error["message"], error["message"]
        assert "no_sync()" in error["message"]


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("loop", ["zero_grad loop", "set-up step, then backward only",
                                  "backward only, zero_grad every 3"])
def test_loops_that_step_once_per_backward_are_not_refused(
        results: list[dict[str, Any]], setup: str, loop: str) -> None:
    for rank_results in results:
        assert rank_results[setup]["accepted"][loop] is None


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _backward(model: nn.Module) -> None:
    model(torch.randn(4, 8)).square().mean().backward()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_optimizer_in_backward_on_a_module_refuses_it_too(clip: float | None) -> None:
    model = _module()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01,
                                           clip_grad_norm=clip)
    _backward(model)
    opt.step()  # the loop calls step()
    _backward(model)
    after_second = values(model)
    with pytest.raises(overlapkit.ConfigurationError, match=r"optimizer.no_step\(\)"):
        _backward(model)
    assert compare(after_second, values(model))
    opt.step()  # the loop goes on as it should
    _backward(model)
    assert not compare(after_second, values(model))


def test_optimizer_in_backward_on_a_module_raises_at_the_first_accumulation_step() -> None:
    model = _module()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01)
    for _ in range(3):
        _backward(model)
    with pytest.raises(overlapkit.ConfigurationError, match=r"after 3 backwards.*no_step"):
        opt.step()


def test_accumulating_with_no_step_still_equals_the_plain_loop() -> None:
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
               for i in range(6)]
    runs = []
    for overlapped in (False, True):
        model = _module()
        opt: Any = (overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01)
                    if overlapped else torch.optim.AdamW(model.parameters(), lr=0.01))
        for index, x in enumerate(batches):
            last = index % 3 == 2
            if overlapped and not last:
                with opt.no_step():
                    model(x).square().mean().backward()
            else:
                model(x).square().mean().backward()
            if last:
                opt.step()
                opt.zero_grad()
        runs.append(values(model))
    assert compare(*runs)


def test_a_backward_only_loop_with_a_scheduler_gets_no_step_order_warning() -> None:
    """torch warns at the first ``scheduler.step()`` when ``optimizer.step()`` never
    ran ("Detected call of `lr_scheduler.step()` before `optimizer.step()`"); the
    backward that stepped is that step, so torchtune's loop gets no false warning."""
    model = _module()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            _backward(model)
            scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 / 8)
