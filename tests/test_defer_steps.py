"""``defer_steps()``: backwards inside reduce (DDP's buckets) and step nothing, their
gradients stay in ``.grad``, and the next ``step()`` is the plain step of them — with
the clipping of the steps in backward — bitwise; the backward gate is still asked at
each, so a framework refuses a second backward before anything steps (what the
Lightning strategies do in a fit's first optimizer step)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from defer_steps_ranks import SETUPS, run
from helpers import compare, values
from torch import nn

import overlapkit
from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=300)


@pytest.mark.parametrize("setup", SETUPS)
def test_a_deferred_backward_steps_nothing_and_step_takes_the_plain_step(
        results: list[dict[str, Any]], setup: str) -> None:
    for rank_results in results:
        result = rank_results[setup]
        assert result["nothing stepped"], result["nothing stepped"]
        assert result["gradients kept"]
        assert result["values"], result["values"]


def test_the_gate_is_asked_in_a_deferred_window_and_refuses_before_any_step(
        results: list[dict[str, Any]]) -> None:
    for rank_results in results:
        result = rank_results["gated"]
        assert result["asked"] == 2
        assert result["error"] is not None and result["error"]["message"] == "second"
        assert result["unchanged"], result["unchanged"]


def test_on_a_module_deferred_gradients_are_kept_for_the_full_step() -> None:
    def train(deferred: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        opt: Any = (overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01,
                                                     clip_grad_norm=0.05)
                    if deferred else torch.optim.AdamW(model.parameters(), lr=0.01))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        if deferred:
            before = values(model)
            with opt.defer_steps():
                model(x).square().mean().backward()
            assert compare(before, values(model))
            assert all(p.grad is not None for p in model.parameters())
        else:
            model(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        return values(model)

    assert compare(train(False), train(True))
