"""Optimizer options with which torch's own ``step()`` cannot step a model's parameters,
in the plain loop either (fourteenth round): ``differentiable=True`` (its step runs
with autograd on and updates leaves that require grad in place) and
``capturable=True`` on CPU, not fused. With 4b7a286 the plain loop's ``step()`` and,
under ``optimizer_in_backward``, the first ``backward()`` raised torch's own error.
Both techniques now refuse them at set-up (or ``add_param_group``) with a
``ConfigurationError`` naming the option, the plain loop's failure and what to do,
nothing changed; what torch's step takes on CPU (``capturable=True, fused=True``, a
param group's own ``differentiable=True``) trains as the plain loop, bitwise. DDP on 2
gloo ranks: ``tests/optimizer_flags_ranks.py``."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers import rank_batches
from optimizer_flags_ranks import HONOURED, REFUSED, TECHNIQUES, run
from torch import nn

import overlapkit
from overlapkit import ConfigurationError
from overlapkit.distributed import run_distributed

CLASSES = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _kwargs(cls: type[torch.optim.Optimizer], flags: dict[str, Any]) -> dict[str, Any]:
    return dict(flags, momentum=0.9) if cls is torch.optim.SGD else dict(flags)


@pytest.mark.parametrize("name", sorted(CLASSES))
@pytest.mark.parametrize("flags", [{"differentiable": True}, {"capturable": True}],
                         ids=["differentiable", "capturable"])
@pytest.mark.parametrize("learn", [False, True], ids=["", "learn_first_step"])
def test_an_option_torch_cannot_step_is_refused_at_set_up(
        name: str, flags: dict[str, Any], learn: bool) -> None:
    cls = CLASSES[name]
    if cls is torch.optim.SGD and "capturable" in flags:
        pytest.skip("SGD has no capturable")
    model_plain = _model()
    plain = cls(model_plain.parameters(), lr=1e-2, **_kwargs(cls, flags))
    model_plain(rank_batches(0, 1)[0]).sum().backward()
    with pytest.raises((RuntimeError, AssertionError)):  # torch's own, in the plain loop
        plain.step()
    model = _model()
    option = next(iter(flags))
    with pytest.raises(ConfigurationError, match=f"{option}=True") as refused:
        opt = overlapkit.optimizer_in_backward(model, cls, lr=1e-2, **_kwargs(cls, flags))
        if learn:
            opt.learn_first_step(model)
    assert "plain loop's step()" in str(refused.value)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model[0].weight, _model()[0].weight)  # nothing stepped, no hook
    model(rank_batches(0, 1)[0]).sum().backward()  # nothing left registered on the model
    assert torch.equal(model[0].weight, _model()[0].weight)


def _trained(overlap: bool, cls: type[torch.optim.Optimizer], params: Any,
             flags: dict[str, Any], learn: bool) -> list[torch.Tensor]:
    model = _model()
    groups = params(model)
    if overlap:
        opt: Any = overlapkit.optimizer_in_backward(model, cls, params=groups, lr=1e-2,
                                                    **_kwargs(cls, flags))
        if learn:
            opt.learn_first_step(model)
    else:
        opt = cls(groups, lr=1e-2, **_kwargs(cls, flags))
    for batch in rank_batches(0, 3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(batch).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _all(model: nn.Module) -> list[Any]:
    return list(model.parameters())


def _group_differentiable(model: nn.Module) -> list[Any]:
    return [{"params": list(model[0].parameters()), "differentiable": True},
            {"params": list(model[2].parameters())}]


@pytest.mark.parametrize("name", sorted(CLASSES))
@pytest.mark.parametrize(("params", "flags"), [
    (_all, {"capturable": True, "fused": True}),
    (_group_differentiable, {}),
], ids=["capturable fused", "a group's differentiable"])
@pytest.mark.parametrize("learn", [False, True], ids=["", "learn_first_step"])
def test_an_option_torch_steps_on_cpu_is_the_plain_loop(
        name: str, params: Any, flags: dict[str, Any], learn: bool) -> None:
    cls = CLASSES[name]
    if cls is torch.optim.SGD and "capturable" in flags:
        pytest.skip("SGD has no capturable")
    plain = _trained(False, cls, params, flags, learn)
    stepped = _trained(True, cls, params, flags, learn)
    assert all(torch.equal(a, b) for a, b in zip(plain, stepped, strict=True))


def test_a_capturable_group_added_on_cpu_is_refused_at_add_param_group() -> None:
    model = _model()
    for param in model[2].parameters():
        param.requires_grad_(False)
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2)
    model(rank_batches(0, 1)[0]).square().mean().backward()
    opt.step()
    opt.zero_grad()
    for param in model[2].parameters():
        param.requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigurationError, match=r"the param group added\) cannot step "
                       "'2.weight' on cpu"):
        opt.add_param_group({"params": list(model[2].parameters()), "capturable": True})
    assert len(opt.param_groups) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_on_ddp_refused_at_set_up_on_every_rank_and_honoured_bitwise() -> None:
    for found in run_distributed(run, 2, timeout=300):
        for technique in TECHNIQUES:
            for name in REFUSED:
                error, unchanged = found[f"{technique} {name}"]
                assert error is not None and error["type"] == "ConfigurationError", error
                assert f"{name}=True" in error["message"], error
                assert unchanged
            for name in HONOURED:
                assert found[f"{technique} {name}"] is True, (technique, name)
