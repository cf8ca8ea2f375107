"""A new optimizer built on a model an overlapkit optimizer already steps
(:mod:`overlapkit.overlap.rebuild`): reassigned, deleted or released, the rebuilt one
trains bitwise as the plain loop doing the same, the replaced one refuses later use,
an ambiguous rebuild is refused before anything changes, and a plain optimizer on
parameters a live one steps is refused before it steps
(:mod:`overlapkit.overlap.plain_step_guard`)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import rebuild_ranks as ranks_
import torch
from helpers import compare, error_of, rank_batches, values
from torch import nn

import overlapkit
from overlapkit.distributed import run_distributed

HOWS = ranks_.HOWS


def _check_rebuilds(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        threads = {key: r["threads"] for key, r in result.items()}
        assert len(set(threads.values())) == 1, (rank, threads)  # none left behind
        for key, r in result.items():
            assert r["parity"], (rank, key, r["parity"])
            assert r["collected"], (rank, key)
            if key.endswith("reassign"):
                for call in ("step", "zero_grad"):
                    error = r[call]
                    assert error is not None and error["type"] == "ConfigurationError", \
                        (rank, key, call, error)
                    assert "replaced by a later" in error["message"], error
                assert r["release"] is None, (rank, key, r["release"])
                if not key.startswith("sharded"):  # sharded: consolidate first, as ever
                    assert r["state_dict"] is None, (rank, key, r["state_dict"])


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_rebuilt_optimizer_on_a_ddp_model_trains_bitwise_as_the_plain_loop(
        world_size: int) -> None:
    variants = ["overlap_ddp", "optimizer_in_backward"]
    if world_size == 2:
        variants.append("sharded")
    _check_rebuilds(run_distributed(ranks_.rebuilds, world_size, args=(variants,),
                                    timeout=600))


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_plain_optimizer_after_overlap_ddp_is_exact_once_released_and_refused_before(
        world_size: int) -> None:
    for rank, result in enumerate(run_distributed(ranks_.plain_after_drop, world_size,
                                                  timeout=300)):
        assert result["released"], (rank, result["released"])
        for how in ("dropped", "held"):
            error = result[how]
            assert error is not None and error["type"] == "ConfigurationError", \
                (rank, how, error)
            assert "release()" in error["message"], error
            assert result[f"{how}: unchanged by the refused step"], result


# -- optimizer_in_backward on a plain module ------------------------------------------

def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _train(model: nn.Module, opt: Any, data: list[torch.Tensor]) -> None:
    for x in data:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _plain(data: list[torch.Tensor], lr: float = 0.1,
           second: type[torch.optim.Optimizer] = torch.optim.SGD) -> list[torch.Tensor]:
    model = _module()
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), data[:2])
    _train(model, second(model.parameters(), lr=lr), data[2:])
    return values(model)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("second, lr", [(torch.optim.SGD, 0.1), (torch.optim.Adam, 3e-3)])
def test_optimizer_in_backward_rebuilt_on_a_module_trains_bitwise_as_the_plain_loop(
        how: str, second: type[torch.optim.Optimizer], lr: float) -> None:
    data = rank_batches(0, 4)
    model = _module()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.Adam, lr=1e-2)
    _train(model, opt, data[:2])
    first = weakref.ref(opt)
    kept = opt if how == "reassign" else None
    if how == "release":
        opt.release()
    if how != "reassign":
        del opt
        gc.collect()
    opt = overlapkit.optimizer_in_backward(model, second, lr=lr)
    _train(model, opt, data[2:])
    assert compare(_plain(data, lr, second), values(model))
    if kept is not None:
        for call in (kept.step, kept.zero_grad,
                     lambda: kept.add_param_group({"params": [nn.Parameter(torch.ones(1))]})):
            error = error_of(call)
            assert error is not None and "replaced by a later" in error["message"], error
        del kept
    del opt
    gc.collect()
    assert first() is None


def test_a_rebuild_over_part_of_a_live_optimizers_parameters_is_refused_before_anything_changes(
) -> None:
    data = rank_batches(0, 3)
    model = _module()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.Adam, lr=1e-2)
    _train(model, opt, data[:1])
    error = error_of(lambda: overlapkit.optimizer_in_backward(
        model, torch.optim.SGD, params=[model[0].weight], lr=0.1))
    assert error is not None and error["type"] == "ConfigurationError", error
    assert "only part" in error["message"] and "release()" in error["message"], error
    _train(model, opt, data[1:])  # the first one still steps everything
    plain = _module()
    _train(plain, torch.optim.Adam(plain.parameters(), lr=1e-2), data)
    assert compare(values(plain), values(model))


def test_a_rebuild_between_a_stepping_backward_and_step_is_refused() -> None:
    data = rank_batches(0, 2)
    model = _module()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.Adam, lr=1e-2)
    _train(model, opt, data[:1])
    model(data[1]).square().mean().backward()
    error = error_of(lambda: overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1))
    assert error is not None and "step() has not been called" in error["message"], error
    opt.step()  # the first one is not retired
    opt.zero_grad()


@pytest.mark.parametrize("how", ["dropped", "released"])
def test_a_plain_optimizer_after_optimizer_in_backward_dropped_or_released_is_exact(
        how: str) -> None:
    data = rank_batches(0, 4)
    model = _module()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.Adam, lr=1e-2)
    _train(model, opt, data[:2])
    if how == "released":
        opt.release()
    del opt
    gc.collect()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), data[2:])
    assert compare(_plain(data), values(model))


def test_a_backward_only_loop_that_keeps_no_optimizer_still_trains() -> None:
    data = rank_batches(0, 3)
    model, plain = _module(), _module()
    overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)  # not kept
    gc.collect()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for x in data:
        model(x).square().mean().backward()
        plain(x).square().mean().backward()
        plain_opt.step()
        plain_opt.zero_grad()
    assert compare(values(plain), values(model))


def test_a_plain_optimizer_beside_a_held_optimizer_in_backward_is_refused_before_it_steps(
) -> None:
    data = rank_batches(0, 3)
    model = _module()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.Adam, lr=1e-2)
    _train(model, opt, data[:1])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    model(data[1]).square().mean().backward()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = values(model)
    error = error_of(sgd.step)
    assert error is not None and error["type"] == "ConfigurationError", error
    assert "release()" in error["message"], error
    assert compare(before, values(model))


def test_parameters_left_to_a_plain_optimizer_with_params_are_not_refused() -> None:
    data = rank_batches(0, 3)
    model, plain = _module(), _module()
    first = list(model[0].parameters())
    opt = overlapkit.optimizer_in_backward(model, torch.optim.Adam, params=first, lr=1e-2)
    sgd = torch.optim.SGD(model[2].parameters(), lr=0.1)
    plain_adam = torch.optim.Adam(plain[0].parameters(), lr=1e-2)
    plain_sgd = torch.optim.SGD(plain[2].parameters(), lr=0.1)
    for x in data:
        model(x).square().mean().backward()
        opt.step()
        sgd.step()
        opt.zero_grad()
        sgd.zero_grad()
        plain(x).square().mean().backward()
        plain_adam.step()
        plain_sgd.step()
        plain_adam.zero_grad()
        plain_sgd.zero_grad()
    assert compare(values(plain), values(model))


def test_the_plain_step_guard_leaves_the_engines_steps_past_torchs_wrapper() -> None:
    from torch.optim import optimizer as torch_optimizer

    from overlapkit.overlap.core.direct_step import unwrapped_step

    opt = overlapkit.optimizer_in_backward(_module(), torch.optim.Adam, lr=1e-2)
    assert torch_optimizer._global_optimizer_pre_hooks  # the guard is installed
    assert unwrapped_step(opt.optimizer) is not None


@pytest.mark.parametrize("world_size", [1, 2])
def test_optimizer_in_backward_after_a_released_overlap_ddp_trains_bitwise_as_the_plain_loop(
        world_size: int) -> None:
    for rank, result in enumerate(run_distributed(ranks_.switch_technique, world_size,
                                                  timeout=300)):
        refused = result["refused"]
        assert refused is not None and "release()" in refused["message"], (rank, refused)
        assert result["parity"], (rank, result["parity"])


def _two_overlapped_optimizers_on_one_ddp_model(rank: int, world_size: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        ddp = DDP(_module())
        encoder, decoder = list(ddp.module[0].parameters()), list(ddp.module[2].parameters())
        opt = getattr(overlapkit, technique)(ddp, torch.optim.Adam, lr=1e-2, params=encoder)
        build = getattr(overlapkit, technique)
        out[technique] = error_of(lambda ddp=ddp, decoder=decoder, build=build: build(
            ddp, torch.optim.SGD, lr=0.1, params=decoder))
        plain_ddp = DDP(_module())
        plain = torch.optim.Adam(plain_ddp.module[0].parameters(), lr=1e-2)
        _train(ddp, opt, rank_batches(rank, 2))  # the first one still steps the encoder
        _train(plain_ddp, plain, rank_batches(rank, 2))
        out[f"{technique} after"] = compare(values(plain_ddp), values(ddp))
    return out


def test_a_second_overlapped_optimizer_on_one_ddp_model_is_refused_naming_param_groups(
) -> None:
    results = run_distributed(_two_overlapped_optimizers_on_one_ddp_model, 1, timeout=120)[0]
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        error = results[technique]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "param groups of one call" in error["message"], error
        assert results[f"{technique} after"], results[f"{technique} after"]


def test_a_rebuild_on_a_ddp_model_tracking_usage_trains_bitwise_as_the_plain_loop() -> None:
    # static_graph=True, find_unused_parameters=True (a head unused on alternate steps)
    for rank, result in enumerate(run_distributed(ranks_.rebuilds_tracking_usage, 2,
                                                  timeout=300)):
        for key, parity in result.items():
            assert parity, (rank, key, parity)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_new_ddp_model_around_the_module_after_unfreezing_trains_bitwise_once_the_old_is_dropped(
        world_size: int) -> None:
    for rank, result in enumerate(run_distributed(ranks_.new_ddp_after_unfreezing, world_size,
                                                  timeout=300)):
        for technique, comparison in result.items():
            assert not isinstance(comparison, str) and comparison, (rank, technique, comparison)


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_advice_of_a_plain_step_refused_after_a_dropped_optimizer_is_followable_and_exact(
        world_size: int) -> None:
    for rank, result in enumerate(run_distributed(
            ranks_.dropped_then_plain_following_the_advice, world_size, timeout=300)):
        for key, comparison in result.items():
            assert not isinstance(comparison, (str, dict, type(None))) and comparison, \
                (rank, key, comparison)
