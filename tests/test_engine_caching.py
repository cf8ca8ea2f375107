"""What the engine keeps from one step to the next, and the shortcuts it takes past
``step()``, stay exactly plain ``step()``: step plans and bucket layouts are made again
when parameters or DDP's buckets change; ``Adam``, ``AdamW`` and ``SGD`` stepped
functionally are bitwise their ``step()``, and the shortcuts step aside for hooks, a
profiler, a patched ``step``, a subclass, a ``GradScaler``, ``fused``, ``capturable`` and a
tensor ``lr`` with ``foreach``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from engine_caching_ranks import (
    DDP_SETUPS,
    OPTIMIZERS,
    comm_hook_run,
    many_buckets_run,
    one_rank_hook_run,
    sparse_hook_run,
    three_ranks_run,
)
from helpers import compare, failures
from torch import nn

from overlapkit.distributed import run_distributed
from overlapkit.overlap.core.bucket_layout import BucketLayouts
from overlapkit.overlap.core.functional_step import FUNCTIONAL_STEPS, step_functionally
from overlapkit.overlap.core.generic import GenericOverlapEngine

# -- many buckets, tied / unused / frozen parameters, 2 gloo ranks --------------------


@pytest.fixture(scope="module")
def many_buckets() -> list[dict[str, Any]]:
    return run_distributed(many_buckets_run, 2, timeout=300)


@pytest.mark.parametrize("setup", sorted(DDP_SETUPS))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_many_buckets_stay_bitwise_plain_ddp(many_buckets: list[dict[str, Any]], name: str,
                                             setup: str) -> None:
    key = f"{name} {setup}"
    assert failures([{key: r[key]["equal"]} for r in many_buckets], key) == {}
    assert all(r[key]["moved"] for r in many_buckets)
    assert many_buckets[0][key]["buckets"] >= 12


def test_three_ranks_stay_bitwise_plain_ddp() -> None:
    # plain DDP averages by multiplying with 1/3 (or, a gradient kept as a bucket
    # view, by dividing), torch's allreduce_hook by dividing
    (result, *others) = run_distributed(three_ranks_run, 3, timeout=300)
    assert len(result) == 3 * len(DDP_SETUPS) + 4
    assert [key for key in result if failures([result, *others], key)] == []


def test_a_sparse_gradient_is_averaged_as_plain_ddp_averages_it() -> None:
    assert failures(run_distributed(sparse_hook_run, 3), "equal") == {}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_overlapkit_allreduce_hook_is_ddp_s_own_reduction(world_size: int) -> None:
    results = run_distributed(comm_hook_run, world_size)
    assert failures(results, "no hook") == {}  # plain DDP, bitwise
    if world_size < 3:  # torch's hook divides: the same bits for a power of two only
        assert failures(results, "torch") == {}


def test_a_one_rank_group_s_buckets_are_returned_reduced_without_a_collective() -> None:
    (result,) = run_distributed(one_rank_hook_run, 1)
    assert result["buckets"] >= 2
    assert result["complete"] and result["the bucket itself"]
    assert result["collectives"] == 0


# -- step plans -----------------------------------------------------------------------


def _params(count: int, size: int = 3) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(size)) for _ in range(count)]


def _grads(params: list[nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)


def test_a_plan_made_before_add_param_group_is_made_again() -> None:
    params = _params(3)
    engine = GenericOverlapEngine(torch.optim.SGD(params[:2], lr=0.1))
    plan = engine.plan(params)
    assert plan.params == params[:2]  # the third is not the engine's yet
    engine.add_param_group({"params": [params[2]], "lr": 0.5})
    assert engine.layout_version != plan.version
    _grads(params, seed=1)
    before = params[2].detach().clone()
    engine.step_plan(plan)
    assert torch.equal(params[2], before - 0.5 * params[2].grad)


def test_lr_changed_between_steps_is_used_by_a_kept_plan() -> None:
    params, reference = _params(2), _params(2)
    engine = GenericOverlapEngine(torch.optim.Adam(params, lr=0.1))
    plain = torch.optim.Adam(reference, lr=0.1)
    plan = engine.plan(params)
    for step in range(3):
        _grads(params, seed=step)
        _grads(reference, seed=step)
        engine.step_plan(plan)
        plain.step()
        for group in engine.param_groups + plain.param_groups:
            group["lr"] *= 0.5
    assert compare(reference, params)


# -- bucket layouts -------------------------------------------------------------------


class FakeBucket:
    """What BucketLayouts reads of DDP's GradBucket."""

    def __init__(self, index: int, params: list[torch.Tensor], buffer: torch.Tensor) -> None:
        self._index, self._params, self._buffer = index, params, buffer

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def buffer(self) -> torch.Tensor:
        return self._buffer


def test_a_bucket_layout_is_kept_while_ddp_keeps_the_buffer() -> None:
    params = _params(2)
    layouts = BucketLayouts(GenericOverlapEngine(torch.optim.SGD(params, lr=0.1)))
    bucket = FakeBucket(0, params, torch.zeros(6))
    first = layouts.get(bucket, bucket.buffer())
    assert layouts.get(bucket, bucket.buffer()) is first
    assert first.owned == params
    assert [v.data_ptr() for v in first.views] == [bucket.buffer().data_ptr(),
                                                   bucket.buffer()[3:].data_ptr()]


def test_rebuilt_buckets_get_new_layouts_and_the_old_buffers_are_dropped() -> None:
    params = _params(3)
    layouts = BucketLayouts(GenericOverlapEngine(torch.optim.SGD(params, lr=0.1)))
    old = [layouts.get(FakeBucket(0, params[:2], b := torch.zeros(6)), b),
           layouts.get(FakeBucket(1, params[2:], c := torch.zeros(3)), c)]
    # DDP rebuilt its buckets after the first iteration: other parameters, new buffers
    rebuilt = FakeBucket(0, [params[2], params[0]], torch.zeros(6))
    new = layouts.get(rebuilt, rebuilt.buffer())
    assert new.owned == [params[2], params[0]] and new is not old[0]
    assert new.views[1].data_ptr() == rebuilt.buffer()[3:].data_ptr()
    assert layouts._by_index == {0: new}  # bucket 1's old buffer is not kept alive


def test_a_bucket_layout_follows_the_engine_s_parameters() -> None:
    params = _params(2)
    engine = GenericOverlapEngine(torch.optim.SGD(params[:1], lr=0.1))
    layouts = BucketLayouts(engine)
    bucket = FakeBucket(0, params, torch.zeros(6))
    assert layouts.get(bucket, bucket.buffer()).owned == params[:1]
    engine.add_param_group({"params": params[1:]})
    assert layouts.get(bucket, bucket.buffer()).owned == params


# -- the functional path ----------------------------------------------------------------

#: optimizer set-ups stepped functionally on CPU
FUNCTIONAL: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "Adam": (torch.optim.Adam, {"lr": 0.1}),
    "Adam-amsgrad-wd-maximize": (torch.optim.Adam, {"lr": 0.1, "amsgrad": True,
                                                    "weight_decay": 0.1, "maximize": True}),
    "Adam-tensor-lr-betas": (torch.optim.Adam, {"lr": torch.tensor(0.1),
                                                "betas": (torch.tensor(0.8), torch.tensor(0.9))}),
    "Adam-foreach-False": (torch.optim.Adam, {"lr": 0.1, "foreach": False}),
    "Adam-foreach-True": (torch.optim.Adam, {"lr": 0.1, "foreach": True}),
    "AdamW-foreach-amsgrad": (torch.optim.AdamW, {"lr": 0.1, "foreach": True,
                                                  "amsgrad": True, "weight_decay": 0.1}),
    "SGD-foreach": (torch.optim.SGD, {"lr": 0.1, "foreach": True}),
    "SGD-foreach-momentum": (torch.optim.SGD, {"lr": 0.1, "foreach": True,
                                               "momentum": 0.9, "nesterov": True}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.2}),
    "SGD": (torch.optim.SGD, {"lr": 0.1}),
    "SGD-momentum-dampening": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9,
                                                 "dampening": 0.2, "weight_decay": 0.1}),
    "SGD-nesterov-maximize": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9,
                                                "nesterov": True, "maximize": True}),
}


def _two_groups(params: list[nn.Parameter], kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"params": params[:3]}, {"params": params[3:], "lr": 0.05}]


@pytest.mark.parametrize("name", sorted(FUNCTIONAL))
def test_functional_steps_are_bitwise_step(name: str) -> None:
    optim_cls, kwargs = FUNCTIONAL[name]
    params, reference = _params(5), _params(5)
    optimizer = optim_cls(_two_groups(params, kwargs), **copy.deepcopy(kwargs))
    engine = GenericOverlapEngine(optimizer)
    plain = optim_cls(_two_groups(reference, kwargs), **copy.deepcopy(kwargs))
    for step in range(3):
        _grads(params, seed=step)
        _grads(reference, seed=step)
        params[1].grad = reference[1].grad = None  # a parameter without a gradient
        groups = optimizer.param_groups
        assert step_functionally(optimizer, [(groups[0], [params[2]])])
        engine.step_params([params[4], params[0], params[3]])
        plain.step()
    assert compare(reference, params)
    assert compare(_state_tensors(plain), _state_tensors(optimizer))


def _state_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every state tensor, by parameter index and name (the ``state_dict()`` format)."""
    return {f"{index}.{name}": value
            for index, state in optimizer.state_dict()["state"].items()
            for name, value in state.items() if isinstance(value, torch.Tensor)}


def test_the_functional_path_covers_adam_adamw_and_sgd_on_this_torch() -> None:
    # a torch whose private functions changed turns it off: this says so
    assert set(FUNCTIONAL_STEPS) == {torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD}


def _stepped_functionally(optimizer: torch.optim.Optimizer) -> bool:
    params = optimizer.param_groups[0]["params"]
    _grads(params, seed=0)
    return step_functionally(optimizer, [(optimizer.param_groups[0], params[:1])])


class AdamSubclass(torch.optim.Adam):
    def step(self, closure: Any = None) -> Any:
        self.seen = True
        return super().step(closure)


@pytest.mark.parametrize("case", [
    "foreach with a tensor lr", "fused", "capturable", "differentiable", "subclass",
    "pre hook", "post hook", "instance step", "grad_scale", "profiler"])
def test_the_functional_path_steps_aside(case: str) -> None:
    params = _params(2)
    options = {"foreach with a tensor lr": {"foreach": True},
               "fused": {"fused": True},
               "capturable": {"capturable": True},
               "differentiable": {"differentiable": True}}.get(case, {})
    options.setdefault("lr", 0.1)
    optimizer = (AdamSubclass if case == "subclass" else torch.optim.Adam)(params, **options)
    if case == "foreach with a tensor lr":  # step() raises; Adam() refuses it at first
        optimizer.param_groups[0]["lr"] = torch.tensor(0.1)
    if case == "pre hook":
        optimizer.register_step_pre_hook(lambda *args: None)
    if case == "post hook":
        optimizer.register_step_post_hook(lambda *args: None)
    if case == "instance step":
        optimizer.step = optimizer.step  # type: ignore[method-assign]
    if case == "grad_scale":
        optimizer.grad_scale = torch.ones(())  # type: ignore[attr-defined]
    if case == "profiler":
        with torch.profiler.profile():
            assert not _stepped_functionally(optimizer)
        return
    assert not _stepped_functionally(optimizer)
    assert all(not state for state in optimizer.state.values())  # nothing was changed


def test_step_hooks_and_the_profiler_see_each_subset_stepped() -> None:
    params = _params(3)
    optimizer = torch.optim.Adam(params, lr=0.1)
    engine = GenericOverlapEngine(optimizer)
    calls: list[int] = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: calls.append(len(opt.param_groups[0]["params"])))
    _grads(params, seed=0)
    with torch.profiler.profile() as profile:
        engine.step_params(params[:1])
        engine.step_params(params[1:])
    assert calls == [1, 2]
    steps = [e for e in profile.events() if e.name == "Optimizer.step#Adam.step"]
    assert len(steps) == 2


def test_a_subclass_overriding_step_is_stepped_through_its_step() -> None:
    params = _params(2)
    optimizer = AdamSubclass(params, lr=0.1)
    _grads(params, seed=0)
    GenericOverlapEngine(optimizer).step_params(params[:1])
    assert optimizer.seen
