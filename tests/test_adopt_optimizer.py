"""overlap_ddp / optimizer_in_backward adopting an existing optimizer instance: the
instance itself is stepped, a scheduler built on it before adoption drives it, and the
training is bitwise the plain optimizer's (1 process and 2 gloo ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import compare, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import overlapkit
from overlapkit.distributed import run_distributed
from overlapkit.errors import ConfigurationError, UnsupportedOptimizerError

STEPS = 4


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [{"params": model[0].parameters(), "weight_decay": 0.1},
         {"params": model[2].parameters(), "weight_decay": 0.0}], lr=0.01)


def _train(model: nn.Module, optimizer: Any, schedule: Any, batches: list[torch.Tensor]
           ) -> None:
    for batch in batches:
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()


def _run(rank: int, wrap: Any, technique: str | None) -> dict[str, Any]:
    batches = rank_batches(rank, STEPS)
    plain = wrap(_model())
    plain_opt = _optimizer(plain.module if hasattr(plain, "module") else plain)
    _train(plain, plain_opt, torch.optim.lr_scheduler.StepLR(plain_opt, 1, gamma=0.5),
           batches)

    model = wrap(_model())
    optimizer = _optimizer(model.module if hasattr(model, "module") else model)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    if technique is None:
        return {}
    overlapped = getattr(overlapkit, technique)(model, optimizer)
    _train(model, overlapped, schedule, batches)
    return {
        "same instance": overlapped.optimizer is optimizer,
        "parameters": compare(values(plain), values(model)),
        "lr": [g["lr"] for g in optimizer.param_groups]
        == [g["lr"] for g in plain_opt.param_groups],
        "state": compare(_state(plain_opt), _state(optimizer)),
    }


def _state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every state tensor, named by its parameter's place in the groups."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {f"{i}.{k}": v for i, p in enumerate(params)
            for k, v in optimizer.state[p].items()}


def _ranks(rank: int, world_size: int, technique: str) -> dict[str, Any]:
    return _run(rank, lambda m: DistributedDataParallel(m), technique)


@pytest.mark.parametrize("technique", ["optimizer_in_backward"])
def test_an_adopted_instance_on_one_process_is_stepped_itself_bitwise(technique: str
                                                                      ) -> None:
    result = _run(0, lambda m: m, technique)
    assert result["same instance"]
    assert result["parameters"], result["parameters"]
    assert result["state"], result["state"]
    assert result["lr"]


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_an_adopted_instance_on_two_ranks_is_stepped_itself_bitwise(technique: str
                                                                    ) -> None:
    for result in run_distributed(_ranks, 2, args=(technique,), timeout=240):
        assert result["same instance"]
        assert result["parameters"], result["parameters"]
        assert result["state"], result["state"]
        assert result["lr"], "the scheduler built on the instance did not drive it"


def test_an_instance_with_optimizer_arguments_is_refused_saying_to_set_them_on_it(
        ) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="set them on the instance"):
        overlapkit.optimizer_in_backward(model, optimizer, lr=0.5)
    assert all(p.grad is None for p in model.parameters())


def test_an_instance_over_parameters_outside_the_model_is_refused() -> None:
    model = _model()
    other = nn.Linear(16, 4)
    with pytest.raises(ConfigurationError, match="not a parameter of"):
        overlapkit.optimizer_in_backward(model, torch.optim.SGD(other.parameters(), lr=0.1))


def test_an_overlapped_optimizer_is_refused_as_an_instance_to_adopt() -> None:
    model = _model()
    overlapped = overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(UnsupportedOptimizerError, match="already an overlapkit"):
        overlapkit.optimizer_in_backward(_model(1), overlapped)


class Lookahead(torch.optim.Optimizer):
    """timm's Lookahead, cut down: a base optimizer stepped from its own ``step()``, then
    every ``k`` steps the parameters pulled halfway back to slow copies."""

    def __init__(self, base: torch.optim.Optimizer, k: int = 2) -> None:
        super().__init__([p for group in base.param_groups for p in group["params"]], {})
        self._base_optimizer, self.k, self.steps = base, k, 0
        self.param_groups = base.param_groups

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._base_optimizer.step(closure)
        self.steps += 1
        for p in (p for group in self.param_groups for p in group["params"]):
            slow = self.state[p].setdefault("slow", p.detach().clone())
            if self.steps % self.k == 0:
                slow.add_(p - slow, alpha=0.5)
                p.copy_(slow)
        return loss


@pytest.mark.parametrize("technique", ["optimizer_in_backward", "overlap_ddp"])
def test_an_optimizer_stepping_another_over_the_same_parameters_is_refused_at_set_up(
        technique: str) -> None:
    """Each part stepped would step the whole base optimizer (before: refused only inside
    the first backward, as "this AdamW steps a parameter ... already stepped", after the
    set-up had claimed the parameters)."""
    if technique == "overlap_ddp":
        error = run_distributed(_adopt_lookahead, 1, timeout=120)[0]
        assert error is not None and "wraps another optimizer (AdamW, its attribute "\
            "'_base_optimizer')" in error, error
        return
    model = _model()
    optimizer = Lookahead(torch.optim.AdamW(model.parameters(), lr=0.01))
    with pytest.raises(UnsupportedOptimizerError, match=r"wraps another optimizer \(AdamW"):
        overlapkit.optimizer_in_backward(model, optimizer)
    # nothing claimed: the base optimizer is adopted as it is, and trains
    overlapkit.optimizer_in_backward(model, optimizer._base_optimizer).release()


def _adopt_lookahead(rank: int, world_size: int) -> str | None:
    model = DistributedDataParallel(_model())
    optimizer = Lookahead(torch.optim.AdamW(model.parameters(), lr=0.01))
    try:
        overlapkit.overlap_ddp(model, optimizer)
    except UnsupportedOptimizerError as error:
        return str(error)
    return None


def test_an_instance_keeps_its_loaded_state() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, 16)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    before = {k: {n: t.clone() for n, t in s.items()} for k, s in optimizer.state.items()}
    overlapped = overlapkit.optimizer_in_backward(model, optimizer)
    assert overlapped.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
    assert all(torch.equal(before[p]["exp_avg"], optimizer.state[p]["exp_avg"])
               for p in before)


def _sharded_adoption(rank: int, world_size: int) -> dict[str, Any]:
    """A used AdamW (state after one plain step, gradients still in .grad) adopted by
    ``overlap_ddp(shard_optimizer_state=True)``, then trained on beside the plain run."""
    batches = rank_batches(rank, STEPS)
    runs = {}
    for name in ("plain", "sharded"):
        model = DistributedDataParallel(_model())
        optimizer = _optimizer(model.module)
        model(batches[0]).square().mean().backward()
        optimizer.step()  # state now, and the gradients left in .grad
        runs[name] = (model, optimizer, [p.detach().clone() for p in model.parameters()])
    model, optimizer, _ = runs["sharded"]
    subclasses = set(torch.optim.AdamW.__subclasses__())
    overlapped = overlapkit.overlap_ddp(model, optimizer, shard_optimizer_state=True)
    made = set(torch.optim.AdamW.__subclasses__()) - subclasses
    untouched = compare(runs["plain"][2], values(model))
    for name, opt in (("plain", runs["plain"][1]), ("sharded", overlapped)):
        opt.zero_grad()
        _train(runs[name][0], opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
               batches[1:])
    return {"classes made": sorted(c.__qualname__ for c in made),
            "untouched by set-up": untouched,
            "parameters": compare(values(runs["plain"][0]), values(model)),
            "same instance": overlapped.optimizer is optimizer}


def test_a_used_instance_adopted_with_sharded_state_is_not_stepped_by_set_up_and_trains_bitwise(
        ) -> None:
    for result in run_distributed(_sharded_adoption, 2, timeout=240):
        assert result["classes made"] == [], "adopting generated an optimizer class"
        assert result["untouched by set-up"], result["untouched by set-up"]
        assert result["parameters"], result["parameters"]
        assert result["same instance"]
