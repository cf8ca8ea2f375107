"""A step skipped on a non-finite gradient norm, with ``clip_grad_norm=``: the global
step sees the inf before stepping and holds it for the loop, so torch's
``clip_grad_norm_(..., error_if_nonfinite=True)`` raises before anything changed, a
loop that checks ``torch.isfinite(norm)`` skips the step with ``zero_grad()``, and one
that calls ``step()`` anyway takes the plain (NaN) step — bitwise the plain loop, on a
plain module and on DDP (2 gloo ranks), for both techniques and
``shard_optimizer_state=True`` (its parameters). 0.4.0 before: the inf step was taken
during backward, then ``zero_grad()`` refused the skip (or the raise came after it)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import compare
from nonfinite_norm_ranks import LOOPS, run, train

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=240)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_plain_module_skips_or_takes_a_non_finite_step_as_the_plain_loop(loop: str) -> None:
    plain = train(None, loop, 0, ddp=False)
    result = compare(plain, train("optimizer_in_backward", loop, 0, ddp=False),
                     equal_nan=True)
    assert result, result


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward", "sharded"])
@pytest.mark.parametrize("loop", LOOPS)
def test_ddp_skips_or_takes_a_non_finite_step_as_the_plain_loop(
        two_ranks: list[dict[str, Any]], technique: str, loop: str) -> None:
    for rank_results in two_ranks:
        result = rank_results[f"{technique} {loop}"]
        assert result, result
