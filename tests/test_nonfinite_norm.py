"""A step skipped on a non-finite gradient norm, with ``clip_grad_norm=``: the global
step sees the inf before stepping and holds it for the loop, so torch's
``clip_grad_norm_(..., error_if_nonfinite=True)`` raises before anything changed, a
loop that checks ``torch.isfinite(norm)`` skips the step with ``zero_grad()``, and one
that calls ``step()`` anyway takes the plain (NaN) step — bitwise the plain loop, on a
plain module and on DDP (2 gloo ranks), for both techniques and
``shard_optimizer_state=True`` (its parameters). 0.4.0 before: the inf step was taken
during backward, then ``zero_grad()`` refused the skip (or the raise came after it).
Without ``clip_grad_norm=``, a skip on the NaN norm of gradients ``optimizer_in_backward``
freed is refused at that ``zero_grad()`` (0.4.0 before: never refused, every step
taken while the loop meant to skip them all)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import compare
from nonfinite_norm_ranks import LOOPS, run, train

import overlapkit
from overlapkit.distributed import run_distributed
from overlapkit.errors import ConfigurationError


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


def test_a_skip_on_the_nan_norm_of_freed_gradients_is_refused_at_its_zero_grad() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    opt = overlapkit.optimizer_in_backward(model, torch.optim.Adam, lr=0.05)
    model(torch.ones(2, 16)).square().mean().backward()
    with pytest.warns(UserWarning, match="freed during backward"):
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None])
    assert not torch.isfinite(norm)
    with pytest.raises(ConfigurationError, match="clip_grad_norm="):
        opt.zero_grad()
    # a loop that steps after reading it is not refused
    model(torch.ones(2, 16)).square().mean().backward()
    with pytest.warns(UserWarning, match="freed during backward"):
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    opt.step()
    opt.zero_grad()
