"""Tensor lists kept per subset (issue 33, item 3): after its first step a subset is
stepped without ``_init_group``, with the single- or the multi-tensor implementation
``step()`` would choose, and whatever a user changes between steps — a state tensor
swapped, a parameter's state deleted or reset, a state dict loaded into the optimizer
itself, ``amsgrad`` or ``foreach`` switched, a gradient gone — is stepped exactly as the
plain ``step()`` steps it."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import compare
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import overlapkit
from overlapkit.overlap.core.generic import GenericOverlapEngine

SETUPS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "Adam": (torch.optim.Adam, {"lr": 0.1}),
    "Adam-foreach": (torch.optim.Adam, {"lr": 0.1, "foreach": True}),
    "AdamW-amsgrad-foreach": (torch.optim.AdamW, {"lr": 0.1, "amsgrad": True,
                                                  "foreach": True}),
    "AdamW-amsgrad": (torch.optim.AdamW, {"lr": 0.1, "amsgrad": True}),
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "SGD-momentum-foreach": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9,
                                               "foreach": True}),
    "SGD-foreach": (torch.optim.SGD, {"lr": 0.1, "foreach": True}),
}


def _params(count: int = 4) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(5)) for _ in range(count)]


def _grads(params: list[nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


class InitGroupCalls:
    """Counts the optimizer's ``_init_group`` calls (set on the instance: torch's
    method runs unchanged)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.count = 0
        own = optimizer._init_group  # type: ignore[attr-defined]

        def counted(*args: Any) -> Any:
            self.count += 1
            return own(*args)

        optimizer._init_group = counted  # type: ignore[attr-defined]


def _engine_and_plain(name: str) -> tuple[list[nn.Parameter], GenericOverlapEngine,
                                          list[nn.Parameter], torch.optim.Optimizer]:
    optim_cls, kwargs = SETUPS[name]
    params, reference = _params(), _params()
    engine = GenericOverlapEngine(optim_cls(params, **copy.deepcopy(kwargs)))
    plain = optim_cls(reference, **copy.deepcopy(kwargs))
    return params, engine, reference, plain


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_a_subset_s_lists_are_worked_out_once_and_the_steps_stay_bitwise(name: str) -> None:
    params, engine, reference, plain = _engine_and_plain(name)
    buckets = [engine.plan(params[:1]), engine.plan(params[1:])]
    calls = InitGroupCalls(engine.optimizer)
    for step in range(4):
        _grads(params, seed=step)
        _grads(reference, seed=step)
        for plan in buckets:
            engine.step_plan(plan)
        plain.step()
    assert calls.count == 2  # the first step of each subset only
    assert compare(reference, params)
    assert compare(_state(plain), _state(engine.optimizer))


def _state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {f"{index}.{key}": value for index, state in optimizer.state_dict()["state"].items()
            for key, value in state.items()}


def _swap_exp_avg(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    state = optimizer.state.get(params[1], {})
    for key in ("exp_avg", "momentum_buffer"):
        if key in state:
            state[key] = state[key] * 0.5  # a new tensor: the kept list's is stale


def _swap_step(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    state = optimizer.state.get(params[2], {})
    if "step" in state:
        state["step"] = torch.tensor(10.0)
    state.pop("momentum_buffer", None)


def _delete_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    optimizer.state.pop(params[0], None)  # SGD without momentum keeps none


def _reset_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    optimizer.state[params[3]] = {}


def _amsgrad_off(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    for group in optimizer.param_groups:
        if "amsgrad" in group:
            group["amsgrad"] = False
        else:
            group["momentum"] = 0.0


def _switch_foreach(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    for group in optimizer.param_groups:
        group["foreach"] = not group["foreach"]


def _no_grad(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    params[2].grad = None


#: what a user may do between two steps, to the optimizer (and the parameters)
EDITS: dict[str, Callable[[torch.optim.Optimizer, list[nn.Parameter]], None]] = {
    "a state tensor swapped": _swap_exp_avg,
    "step count swapped or momentum buffer deleted": _swap_step,
    "a parameter's state deleted": _delete_state,
    "a parameter's state reset to {}": _reset_state,
    "amsgrad or momentum switched off": _amsgrad_off,
    "foreach switched": _switch_foreach,
    "a gradient gone": _no_grad,
}


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("name", sorted(SETUPS))
def test_a_change_between_steps_is_stepped_as_plain_step_steps_it(name: str,
                                                                  edit: str) -> None:
    params, engine, reference, plain = _engine_and_plain(name)
    buckets = [engine.plan(params[:2]), engine.plan(params[2:])]
    for step in range(4):
        _grads(params, seed=step)
        _grads(reference, seed=step)
        if step == 2:
            EDITS[edit](engine.optimizer, params)
            EDITS[edit](plain, reference)
        for plan in buckets:
            engine.step_plan(plan)
        plain.step()
    assert compare(reference, params)
    assert compare(_state(plain), _state(engine.optimizer))


@pytest.mark.parametrize("name", ["Adam-foreach", "SGD-momentum"])
def test_a_state_dict_loaded_into_the_optimizer_itself_is_stepped(name: str) -> None:
    params, engine, reference, plain = _engine_and_plain(name)
    plan = engine.plan(params)
    saved: dict[str, Any] = {}
    for step in range(5):
        _grads(params, seed=step)
        _grads(reference, seed=step)
        if step == 1:
            saved = copy.deepcopy(plain.state_dict())
        if step == 3:  # past the engine, into the optimizer it steps
            engine.optimizer.load_state_dict(copy.deepcopy(saved))
            plain.load_state_dict(copy.deepcopy(saved))
        engine.step_plan(plan)
        plain.step()
    assert compare(reference, params)


def test_loading_through_the_engine_drops_the_kept_lists() -> None:
    params, engine, _, _ = _engine_and_plain("Adam-foreach")
    plan = engine.plan(params)
    _grads(params, seed=0)
    engine.step_plan(plan)
    assert len(plan.kept) == 1
    engine.load_state_dict(engine.state_dict())
    assert plan.kept == {}  # the old state tensors are not held past the load


def test_a_subset_stepped_once_keeps_nothing() -> None:
    # a global step (clipping, a GradScaler) steps a new subset list every iteration
    params, engine, _, _ = _engine_and_plain("Adam")
    _grads(params, seed=0)
    engine.step_params(params)
    tracked = weakref.ref(engine.optimizer.state[params[0]]["exp_avg"])
    for _ in range(3):
        engine.step_params(params)
    assert len(engine._functional._plans) == 0
    engine.optimizer.state.clear()
    gc.collect()
    assert tracked() is None  # nothing holds the dropped state


def test_a_step_count_that_is_not_a_tensor_raises_as_plain_step_raises() -> None:
    params, engine, reference, plain = _engine_and_plain("Adam")
    plan = engine.plan(params)
    for step in range(3):
        _grads(params, seed=step)
        _grads(reference, seed=step)
        if step == 2:  # an old checkpoint's float step count, set by hand
            engine.optimizer.state[params[0]]["step"] = 2.0
            plain.state[reference[0]]["step"] = 2.0
            with pytest.raises(RuntimeError, match="state_steps") as ours:
                engine.step_plan(plan)
            with pytest.raises(RuntimeError, match="state_steps") as theirs:
                plain.step()
            assert str(ours.value) == str(theirs.value)
            return
        engine.step_plan(plan)
        plain.step()


class ForeachKernels(TorchDispatchMode):
    """Counts the ``_foreach_`` aten ops run."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if "_foreach_" in func.__name__:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("foreach", [True, False])
def test_optimizer_in_backward_steps_kept_lists_with_the_plain_kernels(foreach: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    opt = overlapkit.optimizer_in_backward(model, torch.optim.Adam, lr=0.01,
                                           foreach=foreach)
    plain = torch.optim.Adam(reference.parameters(), lr=0.01, foreach=foreach)
    calls = InitGroupCalls(opt.optimizer if hasattr(opt, "optimizer") else opt)
    kernels = ForeachKernels()
    for step in range(4):
        batch = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        with kernels:
            model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
        reference(batch).square().mean().backward()
        plain.step()
        plain.zero_grad()
        if step == 1:  # between iterations: a state tensor replaced on both
            for optimizer, module in ((opt, model), (plain, reference)):
                first = next(iter(module.parameters()))
                optimizer.state[first]["exp_avg"] = torch.zeros_like(first)
    assert compare(list(reference.parameters()), list(model.parameters()))
    # on CPU the 4 parameters step as one batch: its lists are worked out at its first
    # step, and again after the swap, never per step
    assert calls.count == 1 + 1
    assert (kernels.count > 0) == foreach
