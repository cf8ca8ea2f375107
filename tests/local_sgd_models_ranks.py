"""The rank side of tests/test_local_sgd_models.py: post-local SGD on a model that looks
like a user's (an integer parameter, a frozen layer inside the optimizer, trainable
layers), against torch's PostLocalSGDOptimizer on 4 ranks."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of
from local_sgd_ranks import _torch_post_local_sgd_optimizer, batch
from torch import nn
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

WARMUP, STEPS = 2, 9


class WithIntegerAndFrozen(nn.Module):
    """torch's own post-local SGD test model has an integer parameter; add a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)
        self.calls = nn.Parameter(torch.tensor([3], dtype=torch.int64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(torch.tanh(self.frozen(x)))))


class WithUnused(WithIntegerAndFrozen):
    """Also a trainable layer that no rank uses, registered before the used ones: it
    has no gradient, so torch does not average it, and the flat buffer (whose layout
    decides the order of a ring all-reduce's sums) must not hold it either."""

    def __init__(self) -> None:
        super().__init__()
        used = {name: self._modules.pop(name) for name in ("hidden", "out")}
        self.unused = nn.Linear(8, 24)
        for name, module in used.items():
            self.add_module(name, module)


def _ddp(model: type[nn.Module] = WithIntegerAndFrozen) -> DDP:
    torch.manual_seed(0)
    return DDP(model(), bucket_cap_mb=0.0002,
               find_unused_parameters=model is WithUnused)


def _train(model: DDP, opt: Any, rank: int) -> list[torch.Tensor]:
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # frozen ones too


def _torch_run(rank: int, averager: Any, subgroup_size: int,
               model_cls: type[nn.Module] = WithIntegerAndFrozen) -> list[torch.Tensor]:
    model = _ddp(model_cls)
    subgroup, _ = dist.new_subgroups(group_size=subgroup_size)
    state = PostLocalSGDState(process_group=None, subgroup=subgroup,
                              start_localSGD_iter=WARMUP)
    model.register_comm_hook(state, post_localSGD_hook)
    return _train(model, _torch_post_local_sgd_optimizer(_sgd(model), averager), rank)


def run(rank: int, world_size: int) -> dict[str, Any]:
    names = [n for n, _ in _ddp().module.named_parameters()]
    out: dict[str, Any] = {}
    torch_periodic = _torch_run(rank, PeriodicModelAverager(period=2, warmup_steps=WARMUP), 2)
    ours = _ddp()
    ours_opt = overlapkit.post_local_sgd(ours, _sgd(ours), period=2, warmup_steps=WARMUP,
                                         subgroup_size=2)
    out["periodic"] = compare(torch_periodic, _train(ours, ours_opt, rank), names)

    plan = {2: 2, 4: 4}
    torch_hierarchical = _torch_run(
        rank, HierarchicalModelAverager(OrderedDict(plan), warmup_steps=WARMUP), 1)
    ours = _ddp()
    ours_opt = overlapkit.post_local_sgd(
        ours, _sgd(ours), period=4, warmup_steps=WARMUP, subgroup_size=1,
        averager="hierarchical", period_group_size_dict=plan)
    out["hierarchical"] = compare(torch_hierarchical, _train(ours, ours_opt, rank), names)
    out["integer parameter unchanged"] = int(ours.module.calls.item()) == 3

    names = [n for n, _ in _ddp(WithUnused).module.named_parameters()]
    torch_unused = _torch_run(rank, PeriodicModelAverager(period=2, warmup_steps=WARMUP), 2,
                              WithUnused)
    ours = _ddp(WithUnused)
    ours_opt = overlapkit.post_local_sgd(ours, _sgd(ours), period=2, warmup_steps=WARMUP,
                                         subgroup_size=2)
    out["unused trainable parameter"] = compare(torch_unused, _train(ours, ours_opt, rank),
                                                names)
    dist.barrier()
    return out



def checkpoint_refused(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """overlapkit.checkpoint.save and load with a PostLocalSGDOptimizer: refused on
    every rank before anything is written or changed (it holds one copy of the DDP
    model, so each rank's own parameters and the counters would be lost)."""
    model = _ddp()
    opt = overlapkit.post_local_sgd(model, _sgd(model), period=2, warmup_steps=WARMUP,
                                    subgroup_size=1)
    _train(model, opt, rank)
    path = os.path.join(directory, "post-local-sgd")
    before = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    out = {"save": error_of(lambda: overlapkit.checkpoint.save(path, model, opt)),
           "written": os.path.exists(path)}
    out["load"] = error_of(lambda: overlapkit.checkpoint.load(path, model, opt))
    out["unchanged"] = compare(before, [p.detach() for p in model.parameters()])
    out["averager step kept"] = opt.state_dict()["step"] == state["step"]
    dist.barrier()
    return out
