"""A hand-written loop around ``optimizer_in_backward`` on a plain module (1 process),
probed as a hostile user would (the fifth round of the window, ``docs/window.inc``):
what the loop does is either the plain loop's, bitwise, or refused before anything
changes.

- ``zero_grad(set_to_none=False)``: the plain loop keeps a zero gradient for every
  parameter and steps it even where a backward does not reach it; the gradients here
  are freed. Before: None where the plain loop has zeros, and a parameter left out of
  one backward not stepped (measured: Adam 0.0073 off after 3 steps, silently).
- On DDP (2 gloo ranks), a bucket DDP never reduces (a branch left out of a forward,
  ``find_unused_parameters=False``) is refused as that backward ends: its local
  gradients were freed, and it stepped nothing, silently.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hand_written_loops_ranks import run
from helpers import compare
from torch import nn

import overlapkit
from overlapkit.distributed import run_distributed
from overlapkit.errors import ConfigurationError


class _Branchy(nn.Module):
    """A trunk and a branch the loop uses only at some steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        out = self.trunk(x)
        return out + self.branch(out) if use_branch else out


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=generator) for _ in range(count)]


def _zeroing_loop(model: _Branchy, opt: torch.optim.Optimizer) -> None:
    for i, batch in enumerate(_batches(3)):
        opt.zero_grad(set_to_none=False)
        model(batch, use_branch=i != 1).square().mean().backward()
        opt.step()


def test_zero_grad_keeping_zeros_is_refused_before_it_differs() -> None:
    model, plain_model = _Branchy(), _Branchy()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.Adam, lr=0.01)
    with pytest.raises(ConfigurationError, match=r"set_to_none=False.*Nothing was zeroed"):
        _zeroing_loop(model, opt)
    # refused at the second iteration's zero_grad: the first step was the plain one
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01)
    plain_model(_batches(1)[0]).square().mean().backward()
    plain.step()
    assert compare(list(plain_model.parameters()), list(model.parameters()))


def test_zero_grad_to_none_trains_as_the_plain_loop() -> None:
    plain_model, model = _Branchy(), _Branchy()
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01)
    opt = overlapkit.optimizer_in_backward(model, torch.optim.Adam, lr=0.01)
    for m, o in ((plain_model, plain), (model, opt)):
        for i, batch in enumerate(_batches(3)):
            o.zero_grad()
            m(batch, use_branch=i != 1).square().mean().backward()
            o.step()
    assert compare(list(plain_model.parameters()), list(model.parameters()))


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[Any, dict[str, Any]]]:
    return run_distributed(run, 2, timeout=300)


def test_a_ddp_bucket_never_reduced_is_refused_not_left_unstepped(
        two_ranks: list[dict[Any, dict[str, Any]]]) -> None:
    """``find_unused_parameters=False`` and a branch left out of the last forward: DDP
    never reduces the bucket, whose local gradients ``optimizer_in_backward`` had freed.
    Before: that backward stepped nothing and ``step()`` nothing either, silently (the
    plain step, on the unreduced gradients: 0.0099 off)."""
    for found in two_ranks:
        unused = found[False]
        assert unused["plain errors"] == [None, None, None]
        assert unused["errors"][:2] == [None, None], unused
        error = unused["errors"][2]
        assert error is not None and error["type"] == "ConfigurationError", unused
        assert "find_unused_parameters=True" in error["message"]
        assert unused["last backward stepped nothing"]


def test_a_forward_past_ddp_is_refused_naming_it_not_an_unused_parameter(
        two_ranks: list[dict[Any, dict[str, Any]]]) -> None:
    """The wrapped module called for a training forward (``ddp.module(batch)``): DDP
    reduces nothing. Before: the refusal blamed an unused parameter and told to pass
    ``find_unused_parameters=True``, which does not help."""
    for found in two_ranks:
        past = found["past ddp"]
        error = past["error"]
        assert error is not None and error["type"] == "ConfigurationError", past
        assert "did not run through the DistributedDataParallel model" in error["message"]
        assert "find_unused_parameters" not in error["message"]
        assert past["stepped nothing"], past


def test_a_ddp_branch_left_out_with_find_unused_parameters_is_bitwise(
        two_ranks: list[dict[Any, dict[str, Any]]]) -> None:
    for found in two_ranks:
        assert found[True]["errors"] == [None, None, None], found[True]
        assert found[True]["bitwise"], found[True]
