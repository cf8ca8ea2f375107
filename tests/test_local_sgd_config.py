"""Post-local SGD pieces that need no process group: validation, registry, state_dict."""

from __future__ import annotations

import warnings

import pytest
import torch

import overlapkit
from overlapkit.local_sgd.averagers import (
    HierarchicalAverager,
    PeriodicAverager,
    parameters_to_average,
)
from overlapkit.plugin.manager import OverlapkitPluginManager


def _optimizer(warmup_steps: int = 100) -> overlapkit.PostLocalSGDOptimizer:
    # A warm-up longer than the test: the averager counts steps without communicating.
    param = torch.nn.Parameter(torch.ones(3))
    return overlapkit.PostLocalSGDOptimizer(
        torch.optim.SGD([param], lr=0.1, momentum=0.9),
        overlapkit.create_averager("periodic", period=4, warmup_steps=warmup_steps),
    )


def _step(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt.step()


def test_builtin_plugin_provides_averagers_and_comm_hook(
    overlapkit_plugin_manager: OverlapkitPluginManager,
) -> None:
    assert overlapkit_plugin_manager.registry.provided_by("overlapkit.local_sgd") == {
        "averagers": ["hierarchical", "periodic"], "comm_hooks": ["post_local_sgd"]}


def test_create_averager_builds_the_named_averager() -> None:
    averager = overlapkit.create_averager("Periodic", period=3, warmup_steps=2)
    assert isinstance(averager, PeriodicAverager)
    assert (averager.period, averager.warmup_steps, averager.step) == (3, 2, 0)


@pytest.mark.parametrize(("options", "says"), [
    ({"period": 0}, "period must be an integer >= 1"),
    ({"period": 2.5}, "period must be an integer >= 1"),
    ({"period": 2, "warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
    ({}, "needs the options ['period']"),
    ({"period": 2, "momentum": 0.9}, "takes no options ['momentum']"),
])
def test_periodic_bad_options_are_configuration_errors(options: dict, says: str) -> None:
    with pytest.raises(overlapkit.ConfigurationError) as raised:
        overlapkit.create_averager("periodic", **options)
    assert says in str(raised.value)


def test_unknown_averager_lists_the_valid_names(overlapkit_plugin_manager: object) -> None:
    with pytest.raises(overlapkit.UnknownNameError,
                       match="valid names: 'hierarchical', 'periodic'"):
        overlapkit.create_averager("no_such_averager", period=2)


@pytest.mark.parametrize(("plan", "says"), [
    ({}, "non-empty dict"),
    ([(2, 2)], "non-empty dict"),
    ({4: 2, 2: 4}, "strictly increasing"),
    ({0: 2, 4: 4}, "integers >= 1"),
    ({2: 0, 4: 4}, "not a group size"),
])
def test_hierarchical_plan_shape_is_checked_before_any_process_group(
    plan: object, says: str
) -> None:
    with pytest.raises(overlapkit.ConfigurationError) as raised:
        HierarchicalAverager(plan)  # type: ignore[arg-type]
    assert says in str(raised.value)


def test_hierarchical_needs_an_initialized_process_group() -> None:
    with pytest.raises(overlapkit.ConfigurationError, match="init_process_group"):
        overlapkit.create_averager("hierarchical", period_group_size_dict={2: 1})


def test_post_local_sgd_rejects_a_model_that_is_not_ddp() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(overlapkit.UnsupportedModelError, match="DistributedDataParallel"):
        overlapkit.post_local_sgd(model, torch.optim.SGD(model.parameters(), lr=0.1),  # type: ignore[arg-type]
                                  period=2, warmup_steps=1)


def test_wrapper_rejects_what_is_not_an_optimizer_or_averager() -> None:
    averager = overlapkit.create_averager("periodic", period=2)
    with pytest.raises(overlapkit.UnsupportedOptimizerError):
        overlapkit.PostLocalSGDOptimizer(object(), averager)  # type: ignore[arg-type]
    with pytest.raises(overlapkit.ConfigurationError, match="create_averager"):
        overlapkit.PostLocalSGDOptimizer(
            torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), object())  # type: ignore[arg-type]


def test_parameters_to_average_takes_those_with_a_gradient_once_as_torch_does() -> None:
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(2))
    counter = torch.nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)
    a.grad = torch.ones(1)
    assert parameters_to_average([{"params": [a, b, counter]}, {"params": [a]}]) == [a]
    b.grad = torch.ones(2)
    assert parameters_to_average([b, a, counter, b]) == [b, a]


def test_parameters_to_average_without_any_gradient_takes_every_trainable_one() -> None:
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(2))
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    counter = torch.nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)
    assert parameters_to_average([b, frozen, counter, a, b]) == [b, a]
    with pytest.raises(overlapkit.ConfigurationError, match="param_groups"):
        parameters_to_average([3])  # type: ignore[list-item]


def test_wrapper_is_an_optimizer_that_lr_schedulers_and_hooks_accept() -> None:
    opt = _optimizer()
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.optim.param_groups
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    _step(opt)
    scheduler.step()
    assert opt.optim.param_groups[0]["lr"] == pytest.approx(0.05)
    assert calls == [1]
    assert opt.averager.step == 1
    assert opt.step(lambda: 1.5) == 1.5  # closures return the loss


def test_lr_scheduler_still_drives_the_local_optimizer_after_load_state_dict() -> None:
    opt = _optimizer()
    _step(opt)
    opt.load_state_dict(opt.state_dict())  # torch replaces the local param_groups list
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _step(opt)
    scheduler.step()
    assert opt.optim.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.param_groups is opt.optim.param_groups


def test_state_dict_round_trips_the_averager_and_the_optimizer() -> None:
    opt = _optimizer()
    for _ in range(3):
        _step(opt)
    saved = opt.state_dict()
    assert saved["averager"] == {"step": 3} and saved["step"] == 3
    fresh = _optimizer()
    fresh.load_state_dict(saved)
    assert fresh.averager.step == 3
    assert torch.equal(next(iter(fresh.state.values()))["momentum_buffer"],
                       next(iter(opt.state.values()))["momentum_buffer"])


def test_plain_optimizer_checkpoint_loads_with_a_warning() -> None:
    opt = _optimizer()
    _step(opt)
    plain = opt.optim.state_dict()
    fresh = _optimizer()
    with pytest.warns(UserWarning, match="no 'averager'"):
        fresh.load_state_dict(plain)
    assert fresh.averager.step == 0


def test_torch_post_local_sgd_checkpoint_loads_its_step() -> None:
    opt = _optimizer()
    for _ in range(2):
        _step(opt)
    torch_format = {k: v for k, v in opt.state_dict().items() if k != "averager"}
    fresh = _optimizer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(torch_format)
    assert fresh.averager.step == 2


def test_wrapper_checkpoint_loads_into_the_plain_optimizer() -> None:
    opt = _optimizer()
    _step(opt)
    plain = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)
    plain.load_state_dict(opt.state_dict())
    assert plain.state_dict()["state"][0]["momentum_buffer"].tolist() == [1.0, 1.0, 1.0]


def test_averager_load_state_dict_rejects_a_missing_step() -> None:
    with pytest.raises(overlapkit.CheckpointError, match="'averager' entry"):
        PeriodicAverager(2).load_state_dict({})


def test_period_one_warns_that_ddp_is_cheaper() -> None:
    with pytest.warns(UserWarning, match="use plain DDP"):
        PeriodicAverager(1)
