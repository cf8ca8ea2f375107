"""What each rank runs for tests/test_local_sgd.py: every scenario in one spawned run.

Each scenario returns plain data (tensors, numbers, strings); the tests assert on it.
Spawning 4 ranks costs seconds of imports, so one run serves all the tests.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

WARMUP, PERIOD, STEPS, SAVE_AT = 3, 2, 10, 5


def make_ddp() -> DDP:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    )
    # Tiny buckets: several buckets per backward, so the hooks' per-iteration counting
    # (on the last bucket) is exercised.
    return DDP(model, bucket_cap_mb=0.0002)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def sgd(model: torch.nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(model: DDP, opt: torch.optim.Optimizer, rank: int, steps: range) -> list[torch.Tensor]:
    """Run ``steps`` and return the parameters after each step."""
    trajectory = []
    for step in steps:
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        trajectory.append(flat(model))
    return trajectory


def _torch_post_local_sgd_optimizer(optim: torch.optim.Optimizer, averager: Any) -> Any:
    # Imported here: torch.distributed.optim scripts its functional optimizers on import
    # and warns about torch.jit, once per class, in the pytest process otherwise.
    from torch.distributed.optim import PostLocalSGDOptimizer

    return PostLocalSGDOptimizer(optim, averager)


def periodic_parity(rank: int) -> dict[str, Any]:
    """torch's hook + PeriodicModelAverager + PostLocalSGDOptimizer against overlapkit's,
    set up by post_local_sgd and by hand from the registry."""
    torch_model = make_ddp()
    subgroup, _ = dist.new_subgroups(group_size=2)
    state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=WARMUP)
    torch_model.register_comm_hook(state, post_localSGD_hook)
    torch_opt = _torch_post_local_sgd_optimizer(
        sgd(torch_model), PeriodicModelAverager(period=PERIOD, warmup_steps=WARMUP)
    )
    ours = make_ddp()
    ours_opt = overlapkit.post_local_sgd(
        ours, sgd(ours), period=PERIOD, warmup_steps=WARMUP, subgroup_size=2
    )
    manual = make_ddp()
    hook_state, hook = overlapkit.build_comm_hook(
        "post_local_sgd", start_localSGD_iter=WARMUP, subgroup_size=2
    )
    manual.register_comm_hook(hook_state, hook)
    manual_opt = overlapkit.PostLocalSGDOptimizer(
        sgd(manual), overlapkit.create_averager("periodic", period=PERIOD, warmup_steps=WARMUP),
        comm_hook_state=hook_state,
    )
    return {
        "torch": train(torch_model, torch_opt, rank, range(STEPS)),
        "ours": train(ours, ours_opt, rank, range(STEPS)),
        "manual": train(manual, manual_opt, rank, range(STEPS)),
        "hook_iter": ours_opt.comm_hook_state.iter if ours_opt.comm_hook_state else None,
        "averager_step": ours_opt.averager.step,
    }


def hierarchical_parity(rank: int, plan: dict[int, int], warmup: int, steps: int
                        ) -> dict[str, Any]:
    """torch's HierarchicalModelAverager against overlapkit's, no gradient
    communication after warm-up (subgroups of one rank), so every level matters."""
    torch_model = make_ddp()
    singletons, _ = dist.new_subgroups(group_size=1)
    state = PostLocalSGDState(process_group=None, subgroup=singletons, start_localSGD_iter=warmup)
    torch_model.register_comm_hook(state, post_localSGD_hook)
    torch_opt = _torch_post_local_sgd_optimizer(
        sgd(torch_model), HierarchicalModelAverager(OrderedDict(plan), warmup_steps=warmup)
    )
    ours = make_ddp()
    ours_opt = overlapkit.post_local_sgd(
        ours, sgd(ours), period=max(plan), warmup_steps=warmup, subgroup_size=1,
        averager="hierarchical", period_group_size_dict=plan,
    )
    return {
        "torch": train(torch_model, torch_opt, rank, range(steps)),
        "ours": train(ours, ours_opt, rank, range(steps)),
    }


def _post_local_sgd_run(rank: int) -> tuple[DDP, overlapkit.PostLocalSGDOptimizer]:
    model = make_ddp()
    opt = overlapkit.post_local_sgd(
        model, sgd(model), period=PERIOD, warmup_steps=WARMUP, subgroup_size=2
    )
    return model, opt


def _resumed_from(path: Path, rank: int, edit: Callable[[dict[str, Any]], Any],
                  reset_hook: bool = False) -> tuple[list[torch.Tensor], list[str]]:
    model, opt = _post_local_sgd_run(rank)
    checkpoint = torch.load(path, weights_only=True)
    model.module.load_state_dict(checkpoint["model"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(edit(checkpoint["optim"]))
    if reset_hook and opt.comm_hook_state is not None:
        opt.comm_hook_state.iter = 0  # what a fresh torch hook state does on resume
    return train(model, opt, rank, range(SAVE_AT, STEPS)), [str(w.message) for w in caught]


def resume(rank: int, directory: str) -> dict[str, Any]:
    """An uninterrupted run against one saved to disk after SAVE_AT steps (just after
    a step without averaging: ranks of different subgroups differ) and resumed in
    fresh objects."""
    model, opt = _post_local_sgd_run(rank)
    uninterrupted = train(model, opt, rank, range(STEPS))

    model, opt = _post_local_sgd_run(rank)
    train(model, opt, rank, range(SAVE_AT))
    path = Path(directory) / f"rank{rank}.pt"
    torch.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, path)
    saved_optim_keys = sorted(opt.state_dict())
    del model, opt

    model, opt = _post_local_sgd_run(rank)
    checkpoint = torch.load(path, weights_only=True)
    model.module.load_state_dict(checkpoint["model"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(checkpoint["optim"])
    hook = opt.comm_hook_state
    assert hook is not None
    after_load = {"hook_iter": hook.iter, "in_warmup": hook.in_warmup,
                  "averager_step": opt.averager.step}
    groups_used = []
    # The group of every post-resume backward, read before the backward runs.
    resumed = []
    for step in range(SAVE_AT, STEPS):
        groups_used.append(hook.current_group is hook.process_group)
        resumed.extend(train(model, opt, rank, range(step, step + 1)))
    torch_format, torch_format_warnings = _resumed_from(
        path, rank, lambda sd: {k: v for k, v in sd.items() if k not in ("averager", "comm_hook")})
    warmup_again, _ = _resumed_from(path, rank, lambda sd: sd, reset_hook=True)
    return {
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "resumed_from_torch_format": torch_format,
        "torch_format_warnings": torch_format_warnings,
        "resumed_into_warmup_again": warmup_again,
        "after_load": after_load,
        "global_grad_allreduce_after_resume": groups_used,
        "load_warnings": [str(w.message) for w in caught],
        "saved_optim_keys": saved_optim_keys,
    }


def zero_grad_none(rank: int, world_size: int) -> dict[str, Any]:
    """Averaging after zero_grad(set_to_none=True), and with a parameter that has a
    gradient on some ranks only (pytorch #74157)."""
    used = torch.nn.Parameter(torch.full((3,), float(rank)))
    frozen = torch.nn.Parameter(torch.full((2, 2), float(10 * rank)))
    opt = overlapkit.PostLocalSGDOptimizer(
        torch.optim.SGD([used, frozen], lr=0.0),
        overlapkit.create_averager("periodic", period=2, warmup_steps=0),
    )
    if rank % 2 == 0:  # only even ranks give `frozen` a gradient
        frozen.grad = torch.zeros_like(frozen)
    used.grad = torch.zeros_like(used)
    opt.step()  # step 0: averaging step
    partial = (used.detach().clone(), frozen.detach().clone())

    for p in (used, frozen):
        with torch.no_grad():
            p.fill_(float(rank + 1))
    opt.zero_grad(set_to_none=True)
    averager = opt.averager
    averager.step = 2  # an averaging step again
    averaged = averager.average_parameters(opt.param_groups)
    mean_of_ranks = sum(range(world_size)) / world_size
    return {
        "partial": partial,
        "expected_partial": (mean_of_ranks, 10 * mean_of_ranks),
        "all_none_averaged": averaged,
        "all_none_values": (used.detach().clone(), frozen.detach().clone()),
        "expected_all_none": mean_of_ranks + 1,
    }


def default_subgroup(rank: int) -> dict[str, Any]:
    """The subgroup post_local_sgd picks without subgroup_size, on CPU."""
    out: dict[str, Any] = {}

    def ranks_of(opt: overlapkit.PostLocalSGDOptimizer) -> list[int] | None:
        state = opt.comm_hook_state
        assert state is not None
        if state.subgroup is None:
            return None
        return dist.get_process_group_ranks(state.subgroup)

    model = make_ddp()  # run_distributed sets LOCAL_WORLD_SIZE=4: one node
    out["local_world_4"] = ranks_of(overlapkit.post_local_sgd(
        model, sgd(model), period=2, warmup_steps=1))

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    model = make_ddp()
    opt = overlapkit.post_local_sgd(model, sgd(model), period=3, warmup_steps=1)
    out["local_world_2"] = ranks_of(opt)
    out["local_world_2_trajectory"] = train(model, opt, rank, range(4))

    del os.environ["LOCAL_WORLD_SIZE"]
    model = make_ddp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = overlapkit.post_local_sgd(model, sgd(model), period=2, warmup_steps=1)
    out["unset"] = ranks_of(opt)
    out["unset_warnings"] = [str(w.message) for w in caught]
    out["unset_trajectory"] = train(model, opt, rank, range(4))
    return out


def _error(call: Callable[[], Any]) -> tuple[str, str, bool] | None:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc), isinstance(exc, overlapkit.OverlapkitError)
    return None


def errors(rank: int) -> dict[str, Any]:
    """Bad input that can only be judged with a process group: each a clear error,
    raised on every rank before any collective (or the run would hang)."""
    model = make_ddp()
    out = {
        "subgroup_size_3": _error(lambda: overlapkit.post_local_sgd(
            model, sgd(model), period=2, warmup_steps=1, subgroup_size=3)),
        "hier_size_not_dividing": _error(lambda: overlapkit.create_averager(
            "hierarchical", period_group_size_dict={2: 3, 4: 4})),
        "hier_last_not_world": _error(lambda: overlapkit.create_averager(
            "hierarchical", period_group_size_dict={2: 1, 4: 2})),
        "hier_period_mismatch": _error(lambda: overlapkit.post_local_sgd(
            model, sgd(model), period=2, warmup_steps=1, subgroup_size=2,
            averager="hierarchical", period_group_size_dict={2: 2, 4: 4})),
        "unknown_averager": _error(lambda: overlapkit.post_local_sgd(
            model, sgd(model), period=2, warmup_steps=1, averager="no_such_averager")),
        "averager_unknown_option": _error(lambda: overlapkit.post_local_sgd(
            model, sgd(model), period=2, warmup_steps=1, subgroup_size=2, momentum=0.9)),
        "hook_missing_start": _error(lambda: overlapkit.build_comm_hook(
            "post_local_sgd", subgroup_size=2)),
        "hook_unknown_option": _error(lambda: overlapkit.build_comm_hook(
            "post_local_sgd", start_localSGD_iter=1, warmup=3)),
    }
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    out["local_world_size_3"] = _error(lambda: overlapkit.post_local_sgd(
        model, sgd(model), period=2, warmup_steps=1))
    os.environ["LOCAL_WORLD_SIZE"] = "4"
    overlapkit.post_local_sgd(model, sgd(model), period=2, warmup_steps=1, subgroup_size=2)
    out["second_comm_hook"] = _error(lambda: overlapkit.post_local_sgd(
        model, sgd(model), period=2, warmup_steps=1, subgroup_size=2))
    return out


def all_scenarios(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    return {
        "periodic": periodic_parity(rank),
        "hierarchical_2": hierarchical_parity(rank, {2: 2, 4: 4}, warmup=2, steps=10),
        "hierarchical_3": hierarchical_parity(rank, {2: 1, 3: 2, 6: 4}, warmup=1, steps=13),
        "resume": resume(rank, directory),
        "zero_grad_none": zero_grad_none(rank, world_size),
        "default_subgroup": default_subgroup(rank),
        "errors": errors(rank),
    }
