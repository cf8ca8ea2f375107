"""A gradient watched in the first window (``learn_first_step``) is the gradient object
itself, its class switched for that time: not a view of it. Before the thirteenth round
it was replaced by an ``as_subclass`` view, kept as one after ``step()``, and torch
refuses ``detach_()`` on a view: the hand-written ``zero_grad`` of Megatron, fairseq or
apex (``p.grad.detach_(); p.grad.zero_()``), and torch's own ``zero_grad(set_to_none=
False)`` of a gradient made with ``create_graph=True``, raised torch's bare "Can't
detach views in-place" under ``optimizer_in_backward`` learnt (1 process, and DDP on 2
gloo ranks: ``tests/window_grad_identity_ranks.py``). Each is now the plain loop,
bitwise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import rank_batches
from torch import nn
from window_grad_identity_ranks import run

import overlapkit
from overlapkit.distributed import run_distributed


def _hand_zeroed(model: nn.Module, opt: Any, batch: torch.Tensor) -> None:
    for param in model.parameters():  # the classic hand-written zero_grad
        if param.grad is not None:
            param.grad.detach_()
            param.grad.zero_()
    model(batch).square().mean().backward()
    opt.step()


def _create_graph(model: nn.Module, opt: Any, batch: torch.Tensor) -> None:
    model(batch).square().mean().backward(create_graph=True)
    opt.step()
    opt.zero_grad(set_to_none=False)  # torch's: detach_() of a gradient with a grad_fn


def _detached_in_window(model: nn.Module, opt: Any, batch: torch.Tensor) -> None:
    model(batch).square().mean().backward()
    for param in model.parameters():
        if param.grad is not None:
            param.grad.detach_()
    opt.step()
    opt.zero_grad()


def _trained(overlap: bool, iteration: Callable[[nn.Module, Any, torch.Tensor], None]
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    if overlap:
        opt: Any = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2)
        opt.learn_first_step(model)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in rank_batches(0, 4):
        iteration(model, opt, batch)
    state = [value for entry in opt.state_dict()["state"].values()
             for value in entry.values()]
    return [p.detach().clone() for p in model.parameters()], state


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("iteration", [_hand_zeroed, _create_graph, _detached_in_window],
                         ids=["hand-written zero_grad", "create_graph", "detach_ in window"])
def test_detaching_a_learnt_gradient_is_the_plain_loop(
        iteration: Callable[[nn.Module, Any, torch.Tensor], None]) -> None:
    plain_params, plain_state = _trained(False, iteration)
    params, state = _trained(True, iteration)
    assert all(torch.equal(a, b) for a, b in zip(plain_params, params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain_state, state, strict=True))


def test_a_hand_written_zero_grad_on_ddp_is_the_plain_loop() -> None:
    for found in run_distributed(run, 2, timeout=300):
        assert found["error"] is None, found["error"]
        assert found["equal"], found
