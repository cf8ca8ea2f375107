"""torch.compile'd modules: overlap_ddp and optimizer_in_backward on DDP(compiled module)
(2 gloo ranks) and optimizer_in_backward on a compiled plain module equal the plain
compiled run bitwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from compiled_ranks import STEPS, model, run
from helpers import compare, failures, rank_batches, values

import overlapkit
from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=240)


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_ddp_of_a_compiled_module(results: list[dict[str, Any]], technique: str) -> None:
    assert failures(results, technique) == {}


def test_optimizer_in_backward_on_a_compiled_plain_module() -> None:
    torch._dynamo.reset()
    runs = []
    for in_backward in (False, True):
        compiled = torch.compile(model(), backend="aot_eager")
        opt: Any = (overlapkit.optimizer_in_backward(compiled, torch.optim.AdamW, lr=0.01)
                    if in_backward else torch.optim.AdamW(compiled.parameters(), lr=0.01))
        for x in rank_batches(0, STEPS):
            compiled(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append(values(compiled))
    assert compare(*runs)
