"""The window's tenth round in hand-written loops (one process): the first step's
reads, a step hook registered in the window, a learnt loop's load there.

- ``optimizer_in_backward``'s first step was not watched (the loop's shape not known
  yet): a defensive edit there (``if p.grad is not None: p.grad.mul_(0.5)``) found None
  and skipped, and was warned of only at the second ``step()``
  (``FreedGradientReadWarning``): SGD 0.0032 off after that first step; an EMA updated
  there was one step ahead, warned of at the second ``step()`` too. Both are now
  warned of by the first ``step()``, at the loop's line; a backward-only loop (no
  ``step()``: its next forward reads the values, its gradients are None in the plain
  fused loop too) is warned of nothing.
- A step hook registered between a stepping backward and ``step()``: that step was
  taken during backward without it, and the next backward deferred the steps for it,
  with a warning saying the run was the plain loop's: 0.0046 off the plain SGD loop
  after 4 steps of a halving pre-hook (0.004 over DDP). Now refused at that
  ``step()``, naming where the hook is and to register it before the backward.
- A learnt loop (``learn_first_step``) that steps during backward from its second step
  on, loading the optimizer's state between a backward and ``step()``: loaded, then
  refused at ``step()`` (the state replaced already: "optimizer.state (4 entries -> 4,
  a reset)"); a loop not learnt is refused at the load, loading nothing. Now the same.
- ``.grad`` read after ``step()``, before ``zero_grad()`` (a ``LambdaLR`` of the
  gradients' norm stepped after the optimizer, a log of the norm): the plain loop still
  holds the gradients there, ``optimizer_in_backward`` had freed them: the scheduler's
  learning rate differed, 0.023 off the plain SGD loop after 4 steps (0.018 learnt),
  silently. Now warned of once (``FreedGradientReadWarning``), watched until
  ``zero_grad()``, the next backward or forward.
- (eleventh round) A learnt loop calling ``step()`` under ``torch.inference_mode()``:
  its first step's state made there, the second step (during backward) failed with
  torch's bare "Inplace update to inference tensor outside InferenceMode"; now every
  step in the plain order, bitwise, one warning.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import compare, rank_batches
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import overlapkit


def _loop(window: Callable[[nn.Module, Any, int], None], *, steps: int = 3,
          calls_step: bool = True, learn: bool = False) -> list[list[warnings.WarningMessage]]:
    """``steps`` SGD steps of a plain module, ``window(module, opt, step)`` after each
    backward: the warnings of each iteration."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = overlapkit.optimizer_in_backward(module, torch.optim.SGD, lr=0.1, momentum=0.9)
    if learn:
        opt.learn_first_step(module)
    caught = []
    for index, batch in enumerate(rank_batches(0, steps)):
        with warnings.catch_warnings(record=True) as now:
            warnings.simplefilter("always")
            module(batch).square().mean().backward()
            window(module, opt, index)
            if calls_step:
                opt.step()
                opt.zero_grad()
        caught.append(list(now))
    return caught


def _halved(module: nn.Module, opt: Any, step: int) -> None:
    for param in module.parameters():
        if param.grad is not None:  # the line warned of
            param.grad.mul_(0.5)


def _ema(module: nn.Module, opt: Any, step: int, kept: dict[int, Any] = {}) -> None:  # noqa: B006
    average = kept.setdefault(id(opt), [torch.zeros(p.shape) for p in module.parameters()])
    with torch.no_grad():
        for mean, param in zip(average, module.parameters(), strict=True):
            mean.mul_(0.9).add_(param, alpha=0.1)  # the line warned of


def _named(caught: list[warnings.WarningMessage], name: str) -> list[warnings.WarningMessage]:
    return [w for w in caught if w.category.__name__ == name]


@pytest.mark.parametrize(("window", "category"), [
    (_halved, "FreedGradientReadWarning"), (_ema, "ParameterReadInWindowWarning")])
def test_a_read_in_the_first_window_is_warned_of_by_the_first_step(
        window: Any, category: str) -> None:
    # before: warned of by the second step() only, the first one silently different
    caught = _loop(window)
    warned = [_named(now, category) for now in caught]
    assert [len(now) for now in warned] == [1, 0, 0], caught
    found = warned[0][0]
    assert found.filename == __file__, found.filename
    with open(__file__) as source:
        line = source.read().splitlines()[found.lineno - 1]
    assert "the line warned of" in line, line


@pytest.mark.parametrize("window", [_halved, _ema])
def test_a_backward_only_loop_is_not_warned_of_its_reads(window: Any) -> None:
    caught = _loop(window, calls_step=False)
    assert not [w for now in caught for w in now
                if w.category.__name__ in ("FreedGradientReadWarning",
                                           "ParameterReadInWindowWarning")], caught


def test_a_forward_after_the_first_backward_runs_on_plain_parameters() -> None:
    # a backward-only loop's next forward: the first window's watching ends as it
    # starts (a compiled forward would otherwise be compiled again for another class)
    seen = []

    def forward_hook(module: nn.Module, args: Any) -> None:
        seen.extend(type(p) for p in module.parameters())

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    overlapkit.optimizer_in_backward(module, torch.optim.SGD, lr=0.1)
    for batch in rank_batches(0, 2):
        module(batch).square().mean().backward()
        module.register_forward_pre_hook(forward_hook)  # after overlapkit's global one
    assert seen and set(seen) == {nn.Parameter}, seen


def _pre_hook(module: nn.Module, opt: Any, step: int) -> None:
    def halve(optimizer: Any, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.mul_(0.5)

    if step == 1:
        opt.register_step_pre_hook(halve)


def _post_hook(module: nn.Module, opt: Any, step: int) -> None:
    if step == 1:
        opt.register_step_post_hook(lambda optimizer, args, kwargs: None)


def _global_pre_hook(module: nn.Module, opt: Any, step: int) -> None:
    if step == 1:
        handles.append(register_optimizer_step_pre_hook(lambda optimizer, args, kw: None))


handles: list[Any] = []


@pytest.mark.parametrize("learn", [False, True])
@pytest.mark.parametrize("window", [_pre_hook, _post_hook, _global_pre_hook])
def test_a_step_hook_registered_in_the_window_is_refused_at_that_step(
        learn: bool, window: Any) -> None:
    # before: that step taken without the hook (a halving pre-hook 0.0046 off the plain
    # SGD loop after 4 steps), with a warning saying the run was the plain loop's
    try:
        with pytest.raises(overlapkit.ConfigurationError,
                           match=r"registered .* between backward.. and optimizer.step"):
            _loop(window, learn=learn)
    finally:
        while handles:
            handles.pop().remove()


def test_a_learnt_loop_loading_in_the_window_is_refused_loading_nothing() -> None:
    # before: loaded (the state replaced), then refused at step() as a state reset
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=1e-2)
    opt.learn_first_step(module)
    first, second = rank_batches(0, 2)
    module(first).square().mean().backward()
    opt.step()
    opt.zero_grad()
    module(second).square().mean().backward()  # steps during backward: learnt
    before = copy.deepcopy(opt.state_dict())
    halved = copy.deepcopy(before)
    halved["state"][0]["exp_avg"].mul_(0.5)
    with pytest.raises(overlapkit.ConfigurationError, match="Nothing was loaded"):
        opt.load_state_dict(halved)
    assert compare(before["state"][0], opt.state_dict()["state"][0])


def _after_step_loop(read: str, zero_first: bool = False) -> tuple[float, list[Any]]:
    """4 SGD steps of a plain module, the plain optimizer's and ``optimizer_in_backward``'s,
    reading the gradients after ``step()`` (``read``: a ``LambdaLR`` of their norm, or
    a log), ``zero_grad()`` after that or first in the iteration: the largest
    difference, and the warnings."""
    runs = []
    for overlapped in (False, True):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        params = list(module.parameters())
        opt = (overlapkit.optimizer_in_backward(module, torch.optim.SGD, lr=0.1)
               if overlapped else torch.optim.SGD(params, lr=0.1))

        def norm(params: list[torch.Tensor] = params) -> float:
            return sum(float(p.grad.norm()) for p in params if p.grad is not None)

        scheduler = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step, norm=norm: 1 / (1 + norm()))
        logged = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batch in rank_batches(0, 4):
                if zero_first:
                    opt.zero_grad()
                module(batch).square().mean().backward()
                opt.step()
                if read == "scheduler":
                    scheduler.step()
                else:
                    logged.append(norm())
                if not zero_first:
                    opt.zero_grad()
        runs.append(([p.detach().clone() for p in params], list(caught)))
    (plain, _), (ours, caught) = runs
    return max(float((a - b).abs().max()) for a, b in zip(plain, ours, strict=True)), caught


@pytest.mark.parametrize("read", ["scheduler", "log"])
@pytest.mark.parametrize("zero_first", [False, True])
def test_freed_gradients_read_after_step_are_warned_of_once(read: str,
                                                            zero_first: bool) -> None:
    # before: silently (a LambdaLR of the gradients' norm 0.023 off after 4 SGD steps;
    # a log of the norm 0 where the plain loop's is not)
    _, caught = _after_step_loop(read, zero_first)
    warned = _named(caught, "FreedGradientReadWarning")
    assert len(warned) == 1, [str(w.message) for w in caught]
    assert "after optimizer.step()" in str(warned[0].message)
    assert "register_post_accumulate_grad_hook" in str(warned[0].message)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_a_learnt_step_under_inference_mode_keeps_the_plain_order_bitwise(
        optimizer: Any) -> None:
    # 968cf42: the first step's state made under inference_mode, the second step (in
    # backward, outside it) torch's bare "Inplace update to inference tensor" error
    def run(overlapped: bool) -> tuple[list[torch.Tensor], list[str]]:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        settings = {"momentum": 0.9} if optimizer is torch.optim.SGD else {}
        opt: Any = optimizer(module.parameters(), lr=0.1, **settings)
        if overlapped:
            opt = overlapkit.optimizer_in_backward(module, opt)
            opt.learn_first_step(module)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batch in rank_batches(0, 3):
                module(batch).square().mean().backward()
                with torch.inference_mode():
                    opt.step()
                opt.zero_grad()
        return ([p.detach().clone() for p in module.parameters()],
                [str(w.message) for w in caught if "inference_mode" in str(w.message)])

    (plain, _), (got, warned) = run(False), run(True)
    assert compare(plain, got)
    assert len(warned) == 1, warned

