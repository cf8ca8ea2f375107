"""An averager plugin whose builder returns something that is not an averager: a
ConfigurationError naming the averager, before post_local_sgd registers its comm hook
(9b5962c: "NoneType is not a model averager ... build one with create_averager" after the
hook was registered, so the DDP model took no other: the retry with a fixed averager
was refused, "build a fresh DistributedDataParallel")."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.distributed import run_distributed
from overlapkit.errors import CheckpointError, ConfigurationError
from overlapkit.local_sgd.averagers import ModelAverager, PeriodicAverager
from overlapkit.plugin.manager import get_plugin_manager


def _forgets_return(*, period: int, warmup_steps: int, process_group: Any) -> None:
    overlapkit.create_averager("periodic", period=period, warmup_steps=warmup_steps,
                               process_group=process_group)  # the bug: no return


@overlapkit.hookimpl
def overlapkit_register_averagers() -> overlapkit.AveragerRecord:
    return overlapkit.AveragerRecord(name="forgets-return", build=_forgets_return)


def _register() -> None:
    manager = get_plugin_manager()
    if not manager.has_plugin("forgets-return-test"):
        manager.register(SimpleNamespace(
            overlapkit_register_averagers=overlapkit_register_averagers),
            name="forgets-return-test")


def _set_up_twice(rank: int, world_size: int) -> dict[str, Any]:
    _register()
    ddp = DDP(torch.nn.Linear(4, 2))
    try:
        overlapkit.post_local_sgd(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), period=2,
                                  warmup_steps=1, averager="forgets-return", subgroup_size=1)
        refusal = ""
    except ConfigurationError as error:
        refusal = str(error)
    try:
        overlapkit.post_local_sgd(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), period=2,
                                  warmup_steps=1, subgroup_size=1)
        retry = "ok"
    except ConfigurationError as error:
        retry = str(error)
    return {"refusal": refusal, "retry": retry}


def test_a_builder_returning_no_averager_is_refused_before_the_hook_is_registered() -> None:
    result = run_distributed(_set_up_twice, 1, timeout=60)[0]
    assert "'forgets-return'" in result["refusal"] and "NoneType" in result["refusal"]
    assert result["retry"] == "ok", result["retry"]


def test_create_averager_names_the_averager_whose_builder_returned_no_averager(
    overlapkit_plugin_manager: Any,
) -> None:
    _register()
    with pytest.raises(ConfigurationError, match="'forgets-return' returned a NoneType"):
        overlapkit.create_averager("forgets-return", period=2, warmup_steps=0,
                                   process_group=None)


class _NoState(PeriodicAverager):
    def state_dict(self) -> Any:
        return None  # the plugin's bug


class _LoadRaises(PeriodicAverager):
    def load_state_dict(self, state_dict: Any) -> None:
        raise KeyError("momentum")  # the plugin's bug


def test_an_averager_state_that_is_no_dict_is_refused_at_save_not_at_resume() -> None:
    model = torch.nn.Linear(2, 2)
    opt = overlapkit.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           _NoState(period=2))
    # f2b92e2: saved; the resumed run's load_state_dict refused it
    with pytest.raises(ConfigurationError, match=r"_NoState.state_dict\(\) returned a NoneType"):
        opt.state_dict()


def test_an_averager_load_error_is_a_checkpoint_error_naming_it_nothing_loaded() -> None:
    model = torch.nn.Linear(2, 2)
    opt = overlapkit.PostLocalSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _LoadRaises(period=2))
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = 0.5
    # f2b92e2: the plugin's bare KeyError, raised again by the roll-back
    with pytest.raises(CheckpointError, match=r"_LoadRaises.load_state_dict\(\) refused .*"
                       r"KeyError: 'momentum'.*Nothing was loaded"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.1


class _RanksAsGroup(ModelAverager):
    def group_for_step(self, step: int) -> Any:
        return [0, 1]  # the plugin's bug: ranks, not a process group


def _group_of_ranks(rank: int, world_size: int) -> str:
    model = torch.nn.Linear(2, 2)
    opt = overlapkit.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           _RanksAsGroup())
    model(torch.randn(1, 2)).sum().backward()
    try:
        opt.step()
    except ConfigurationError as error:
        return str(error)
    return "no error"


def test_a_group_for_step_returning_no_process_group_is_named() -> None:
    # f2b92e2: AttributeError: 'list' object has no attribute 'size'
    message = run_distributed(_group_of_ranks, 1, timeout=60)[0]
    assert "is a list ([0, 1]), not a process group" in message
    assert "group_for_step(step) must return a torch.distributed ProcessGroup" in message
