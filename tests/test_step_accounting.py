"""Two backwards with no step() or zero_grad() between them — gradient accumulation
without no_sync(), two losses backpropagated separately — would be two steps of an
overlapped optimizer where the plain loop takes one (0.033 off plain DDP after 4
backwards, silently, in 0.1). The second backward is refused: a ConfigurationError on
every rank that says how to accumulate, nothing stepped in it, the ranks still in step.
"""

from __future__ import annotations

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
    return run_distributed(run, 2, timeout=180)


@pytest.mark.parametrize("setup", SETUPS)
def test_a_second_backward_without_step_is_refused_on_every_rank(
        results: list[dict[str, Any]], setup: str) -> None:
    for rank_results in results:
        result = rank_results[setup]
        error = result["error"]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "no_sync()" in error["message"] and "before optimizer.step()" in error["message"]
        assert result["unchanged"], result["unchanged"]  # nothing stepped in it


@pytest.mark.parametrize("setup", SETUPS)
def test_a_loop_ending_each_iteration_with_zero_grad_is_not_refused(
        results: list[dict[str, Any]], setup: str) -> None:
    for rank_results in results:
        assert rank_results[setup]["zero_grad loop"] is None
        assert rank_results[setup]["moved"]


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


@pytest.mark.parametrize("clip", [None, 1.0])
def test_optimizer_in_backward_on_a_module_refuses_it_too(clip: float | None) -> None:
    model = _module()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01,
                                           clip_grad_norm=clip)
    model(torch.randn(4, 8)).square().mean().backward()
    after_first = values(model)
    with pytest.raises(overlapkit.ConfigurationError, match=r"optimizer.no_step\(\)"):
        model(torch.randn(4, 8)).square().mean().backward()
    assert compare(after_first, values(model))
    opt.step()  # the loop goes on as it should
    model(torch.randn(4, 8)).square().mean().backward()
    assert not compare(after_first, values(model))


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
