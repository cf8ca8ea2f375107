"""Reentrant activation checkpointing (``use_reentrant=True``) recomputes its segment and
runs a nested ``torch.autograd.backward`` inside the outer backward: a separate graph
task, which 0.2 counted as a second backward and refused ("backward() ran again before
optimizer.step()") after some buckets had stepped. The nested backwards are now part of
the outer one: bitwise the plain loop, on DDP (dynamic and static graph), a plain module
and FSDP2, also when the first gradients of a backward come from a nested one (the head
inside the last checkpointed segment)."""

from __future__ import annotations

from typing import Any

import pytest
from reentrant_checkpoint_ranks import cases, run

from overlapkit.distributed import run_distributed

CASES = [f"{model} | {technique} | {'head inside' if head else 'head outside'}"
         for model, technique, head in cases()]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=300)


@pytest.mark.parametrize("case", CASES)
def test_reentrant_checkpointing_trains_bitwise_as_the_plain_loop(
        results: list[dict[str, Any]], case: str) -> None:
    for rank_results in results:
        result = rank_results[case]
        assert result["values"], result["values"]
        assert result["trained"]
