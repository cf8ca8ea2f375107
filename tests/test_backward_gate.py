"""What a training framework that runs the backward itself tells an overlapped optimizer
(``gate_backwards``, ``clip_in_order``; used by :mod:`overlapkit.integrations.lightning`).

A gate refuses a stepping backward before anything steps in it, as the loop-shape checks
do; backwards that step nothing never ask it. ``clip_in_order`` makes global clipping
bitwise a plain loop that clips the optimizer's parameters group by group (Lightning's
precision plugins do), where the default clips in ``model.parameters()`` order.
"""

from __future__ import annotations

import pytest
import torch
from helpers import compare, values
from torch import nn

import overlapkit


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _backward(model: nn.Module, seed: int = 0) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_backward_the_gate_refuses_steps_nothing_and_raises_its_error(
        clip: float | None) -> None:
    model = _module()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01,
                                           clip_grad_norm=clip)
    refusal: list[overlapkit.OverlapkitError | None] = [
        overlapkit.ConfigurationError("not here")]
    opt.gate_backwards(lambda: refusal[0])
    before = values(model)
    with pytest.raises(overlapkit.ConfigurationError, match="not here"):
        _backward(model)
    assert compare(before, values(model))
    opt.zero_grad()
    refusal[0] = None
    _backward(model)
    assert not compare(before, values(model))


def test_backwards_that_step_nothing_do_not_ask_the_gate() -> None:
    model = _module()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01)
    asked: list[int] = []
    opt.gate_backwards(lambda: asked.append(1) or None)
    with opt.no_step():
        _backward(model)
    assert asked == []
    _backward(model, seed=1)
    assert asked == [1]
    opt.gate_backwards(None)
    opt.step()
    _backward(model, seed=2)
    assert asked == [1]


def _deeper_module() -> nn.Module:
    """A model whose total gradient norm rounds differently in group order and in
    ``model.parameters()`` order at its first backward (seed 12; measured)."""
    torch.manual_seed(12)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 2))


def _groups(model: nn.Module) -> list[dict[str, object]]:
    """The usual split: weights with decay first, then biases without."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]


@pytest.mark.parametrize("full_step", [False, True], ids=["in backward", "full step"])
def test_clipping_in_the_optimizer_order_is_bitwise_a_loop_clipping_group_by_group(
        full_step: bool) -> None:
    runs = []
    for overlapped in (False, True):
        model = _deeper_module()
        groups = _groups(model)
        opt: torch.optim.Optimizer
        if overlapped:
            facade = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.05,
                                                      params=groups, clip_grad_norm=0.05)
            # without this: 2.61e-07 off after 6 steps (measured)
            facade.clip_in_order(p for g in facade.param_groups for p in g["params"])
            opt = facade
        else:
            opt = torch.optim.AdamW(groups, lr=0.05)
        for step in range(6):
            if overlapped and full_step:
                with facade.no_step():
                    _backward(model, step)
            else:
                _backward(model, step)
            if not overlapped:
                torch.nn.utils.clip_grad_norm_(
                    [p for g in opt.param_groups for p in g["params"]], 0.05)
            opt.step()
            opt.zero_grad()
        runs.append(values(model))
    assert compare(*runs)


def test_a_closure_is_refused_with_the_way_to_use_lightning() -> None:
    """PyTorch Lightning's automatic optimization calls ``step(closure)``: an overlapped
    optimizer handed to it from ``configure_optimizers`` is refused at its first step,
    before the closure runs, naming the strategies that drive it."""
    model = _module()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01)
    ran: list[int] = []
    with pytest.raises(overlapkit.ConfigurationError,
                       match=r"takes no closure.*OverlapDDPStrategy\(\)"):
        opt.step(lambda: ran.append(1))
    assert ran == []
