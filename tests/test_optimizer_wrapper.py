"""OptimizerWrapper: the one base class of overlapkit's optimizers that wrap a real one."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch import nn

import overlapkit
from overlapkit.optimizer_wrapper import OptimizerWrapper, unwrapped

PACKAGE = Path(overlapkit.__file__).parent


def _post_local_sgd_optimizer() -> overlapkit.PostLocalSGDOptimizer:
    model = nn.Linear(3, 2)
    local = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = overlapkit.create_averager("periodic", period=2, warmup_steps=0)
    return overlapkit.PostLocalSGDOptimizer(local, averager)


def test_both_wrappers_share_the_base_class() -> None:
    model = nn.Linear(3, 2)
    in_backward = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01)
    local_sgd = _post_local_sgd_optimizer()
    for opt in (in_backward, local_sgd):
        assert isinstance(opt, OptimizerWrapper)
        assert isinstance(opt, torch.optim.Optimizer)
        assert type(opt.unwrap()) in (torch.optim.AdamW, torch.optim.SGD)
        assert opt.param_groups is opt.unwrap().param_groups
        assert opt.state is opt.unwrap().state


def test_unwrap_reaches_through_nested_wrappers_and_quiesces_each_level() -> None:
    model = nn.Linear(3, 2)
    inner = overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    averager = overlapkit.create_averager("periodic", period=2, warmup_steps=0)
    outer = overlapkit.PostLocalSGDOptimizer(inner, averager)
    real = inner.optimizer
    assert outer.unwrap() is real
    with unwrapped(outer) as got:
        assert got is real
        # the facade's engine lock is held: another thread could not step meanwhile
        assert inner.engine.lock._is_owned()  # type: ignore[attr-defined]
    assert not inner.engine.lock._is_owned()  # type: ignore[attr-defined]


class _CountingAverager:
    """Counts steps; averages nothing (a single process has nothing to average with)."""

    def __init__(self) -> None:
        self.step = 0

    def average_parameters(self, params: object) -> None:
        self.step += 1

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def test_step_hooks_registered_on_a_wrapper_run_around_the_real_step() -> None:
    model = nn.Linear(3, 2)
    opt = overlapkit.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           _CountingAverager())  # type: ignore[arg-type]
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    for p in opt.unwrap().param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert calls == ["pre", "post"]


def test_checkpoint_code_imports_no_technique() -> None:
    """Storage must not depend on techniques: it reaches real optimizers through
    OptimizerWrapper alone."""
    offenders = []
    for path in sorted((PACKAGE / "checkpoint").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import)
                     else [])
            offenders += [f"{path.name}: {n}" for n in names
                          if n.startswith(("overlapkit.overlap", "overlapkit.local_sgd"))]
    assert offenders == []


def test_no_module_calls_torchs_private_patch_step_function() -> None:
    users = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if "_patch_step_function" in p.read_text()]
    assert users == []
