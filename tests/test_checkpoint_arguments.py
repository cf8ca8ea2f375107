"""Checkpoint calls with wrong arguments, a failed final rename, and a
PostLocalSGDOptimizer state dict with bad entries: each is a clear error and changes
nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from helpers import compare, values
from torch import nn

import overlapkit
from overlapkit import checkpoint
from overlapkit.checkpoint import saving
from overlapkit.errors import CheckpointError
from overlapkit.local_sgd.comm_hook import PostLocalSGDHookState


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("call", ["save", "load"])
@pytest.mark.parametrize(("arguments", "text"), [
    (lambda model, opt: (opt,), "model must be a torch.nn.Module"),
    (lambda model, opt: (model, torch.optim.AdamW), "got the class AdamW"),
    (lambda model, opt: (model, "adam"), "optimizer must be a torch.optim.Optimizer"),
    (lambda model, opt: (nn.Linear(4, 8), opt), "not a parameter of the model"),
])
def test_argument_errors_name_the_argument(tmp_path: Path, call: str, arguments: Any,
                                           text: str) -> None:
    model, opt = _trained()
    checkpoint.save(tmp_path / "ck", model, opt)
    with pytest.raises(CheckpointError, match=text):
        getattr(checkpoint, call)(tmp_path / "ck", *arguments(model, opt))


@pytest.mark.parametrize("call", ["save", "load", "inspect"])
def test_a_path_that_is_not_a_path(call: str) -> None:
    model, opt = _trained()
    args: tuple[Any, ...] = (model, opt) if call != "inspect" else ()
    with pytest.raises(CheckpointError, match=r"path must be a str or os\.PathLike"):
        getattr(checkpoint, call)(5, *args)


@pytest.mark.parametrize(("planner", "text"), [
    (5, "got int"),
    (torch.distributed.checkpoint.DefaultSavePlanner(), "got DefaultSavePlanner"),
    (torch.distributed.checkpoint.DefaultLoadPlanner,
     r"the class DefaultLoadPlanner \(pass an instance"),
])
def test_a_planner_of_the_wrong_kind_is_refused_naming_it(tmp_path: Path, planner: Any,
                                                          text: str) -> None:
    model, opt = _trained()
    checkpoint.save(tmp_path / "ck", model, opt)
    fresh_model, fresh_opt = _trained(seed=1)
    fresh_opt.state.clear()
    before = values(fresh_model)
    with pytest.raises(CheckpointError, match=rf"load: planner must be .*{text}"):
        checkpoint.load(tmp_path / "ck", fresh_model, fresh_opt, planner=planner)
    assert compare(before, values(fresh_model))
    assert not fresh_opt.state


def test_a_failed_final_rename_puts_the_previous_checkpoint_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ck"
    model, opt = _trained()
    checkpoint.save(path, model, opt)
    previous = sorted(p.name for p in path.iterdir())
    real_replace = os.replace
    calls = []

    def second_rename_fails(src: Any, dst: Any) -> None:
        calls.append((src, dst))
        if len(calls) == 2:
            raise PermissionError("refused by the file system")
        real_replace(src, dst)

    monkeypatch.setattr(saving.os, "replace", second_rename_fails)
    other, other_opt = _trained(seed=3)
    with pytest.raises(CheckpointError, match="refused by the file system"):
        checkpoint.save(path, other, other_opt)
    monkeypatch.undo()
    assert sorted(p.name for p in path.iterdir()) == previous
    fresh, fresh_opt = _trained(seed=5)
    checkpoint.load(path, fresh, fresh_opt)  # the previous checkpoint, intact
    assert compare(values(model), values(fresh))


def _post_local_sgd() -> overlapkit.PostLocalSGDOptimizer:
    model = nn.Linear(3, 2)
    local = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = overlapkit.create_averager("periodic", period=2, warmup_steps=0)
    hook = PostLocalSGDHookState(process_group=cast(Any, None), subgroup=None,
                                 start_localSGD_iter=10)
    hook.iter = 1
    opt = overlapkit.PostLocalSGDOptimizer(local, averager, comm_hook_state=hook)
    averager.step = 2
    return opt


@pytest.mark.parametrize(("edit", "text"), [
    (lambda sd: sd.update(averager=5), "'averager' entry is a int"),
    (lambda sd: sd.update(averager={"step": -1}), "no valid 'step'"),
    (lambda sd: sd.update(averager={"step": "x"}), "no valid 'step'"),
    (lambda sd: sd.pop("state"), "no 'state' entry"),
    (lambda sd: sd.update(comm_hook={"iter": -3}), "no valid 'iter'"),
    (lambda sd: sd.update(comm_hook=[1]), "'comm_hook' entry is a list"),
    # torch's own check of the groups, after the averager entry was accepted
    (lambda sd: sd.update(param_groups=sd["param_groups"] * 2, averager={"step": 7}),
     "different number of parameter groups"),
])
def test_post_local_sgd_load_state_dict_changes_nothing_when_refused(edit: Any,
                                                                     text: str) -> None:
    opt = _post_local_sgd()
    state = opt.state_dict()
    state["param_groups"][0]["lr"] = 0.5
    edit(state)
    with pytest.raises(CheckpointError, match=text):
        opt.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == 0.1
    assert opt.averager.step == 2
    assert opt.comm_hook_state is not None and opt.comm_hook_state.iter == 1


@pytest.mark.parametrize("state", [None, 5, "state"])
def test_post_local_sgd_load_state_dict_of_something_else(state: Any) -> None:
    opt = _post_local_sgd()
    with pytest.raises(CheckpointError, match="state_dict must be a dict"):
        opt.load_state_dict(state)
    assert opt.averager.step == 2
