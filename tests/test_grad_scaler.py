"""A torch.amp.GradScaler driving an optimizer that steps during backward is refused at
the first scaler.step() with a ConfigurationError — never a silent step on scaled
gradients, never torch's bare "No inf checks were recorded" (2 gloo ranks, and a plain
module here)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from grad_scaler_ranks import run
from torch import nn

import overlapkit
from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=120)


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_a_grad_scaler_is_refused_on_ddp(results: list[dict[str, Any]], technique: str) -> None:
    for rank_results in results:
        error = rank_results[technique]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "GradScaler" in error["message"] and "scaled gradients" in error["message"]
        assert rank_results[f"{technique} plain step after"] is None


def test_a_grad_scaler_is_refused_on_a_plain_module() -> None:
    model = nn.Linear(4, 2)
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    with pytest.raises(overlapkit.ConfigurationError, match="GradScaler"):
        scaler.step(opt)
