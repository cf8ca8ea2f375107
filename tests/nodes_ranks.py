"""What ranks run for tests/test_nodes.py and tests/test_local_sgd_nodes.py.

- :func:`readme_main`: the README's training script, run by ``run_distributed`` ranks
  (one machine, no torchrun): the reference a run on several torchrun nodes is compared
  with;
- :func:`hierarchy`: post-local SGD's hierarchy taken from the launch against the same
  groups given explicitly, on ranks that see the environment torchrun gives the ranks
  of several nodes;
- ``nodes_probe.py`` (a script, under real torchrun agents) does the same there.
"""

from __future__ import annotations

import os
import runpy
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from helpers import error_of
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


def readme_main(rank: int, world_size: int, script: str, env: Mapping[str, str]) -> None:
    """Run the README script's ``main()`` on this rank, with ``env`` (``CHECKPOINT``,
    ``STOP_AT``) set first: the script reads them when it is loaded."""
    os.environ.update(env)
    namespace = runpy.run_path(script, run_name="readme_train")
    namespace["main"]()


def as_node(rank: int, per_node: list[int]) -> None:
    """Give this rank the environment torchrun gives a rank of a job whose nodes run
    ``per_node`` ranks each (node by node, ranks consecutive)."""
    start = 0
    for node, size in enumerate(per_node):
        if rank < start + size:
            os.environ.update(GROUP_RANK=str(node), LOCAL_RANK=str(rank - start),
                              LOCAL_WORLD_SIZE=str(size), GROUP_WORLD_SIZE=str(len(per_node)))
            return
        start += size
    raise ValueError(f"rank {rank} is beyond {per_node}")


def make_ddp() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 4)))


def train(model: DDP, opt: torch.optim.Optimizer, rank: int, steps: int) -> list[torch.Tensor]:
    """Train ``steps`` steps on this rank's own batches; the parameters after each."""
    trajectory = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        trajectory.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return trajectory


def _sgd(model: DDP) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def hierarchy(rank: int, world_size: int, per_node: list[int]) -> dict[str, Any]:
    """The hierarchy from the launch, and the same groups given explicitly, trained
    side by side; with ``per_node`` as torchrun would launch it."""
    as_node(rank, per_node)
    out: dict[str, Any] = {}
    model = make_ddp()
    opt = overlapkit.post_local_sgd(model, _sgd(model), period=4, warmup_steps=2,
                                    averager="hierarchical")
    out["plan"] = dict(opt.averager.period_group_size_dict)
    hook = opt.comm_hook_state
    assert hook is not None
    out["hook_subgroup"] = None if hook.subgroup is None else dist.get_process_group_ranks(
        hook.subgroup)
    out["node_group"] = {period: (None if group is None else dist.get_process_group_ranks(group))
                         for period, group in opt.averager.period_process_group_dict.items()}
    out["from_launch"] = train(model, opt, rank, 10)

    model = make_ddp()
    explicit = overlapkit.post_local_sgd(
        model, _sgd(model), period=4, warmup_steps=2, averager="hierarchical",
        subgroup_size=1, period_group_size_dict={1: per_node[0], 4: world_size})
    out["explicit"] = train(model, explicit, rank, 10)

    model = make_ddp()
    opt = overlapkit.post_local_sgd(model, _sgd(model), period=8, warmup_steps=2,
                                    averager="hierarchical", node_period=3)
    out["node_period_3"] = dict(opt.averager.period_group_size_dict)
    out["created"] = dict(overlapkit.create_averager("hierarchical", period=8)
                          .period_group_size_dict)
    return out


def bad_launch(rank: int, world_size: int, per_node: list[int]) -> dict[str, Any]:
    """What a launch that does not fit the hierarchy gives: an OverlapkitError on every
    rank, before any group is created or anything trained."""
    as_node(rank, per_node)
    first, second = make_ddp(), make_ddp()
    out: dict[str, Any] = {
        "from_launch": error_of(lambda: overlapkit.post_local_sgd(
            first, _sgd(first), period=4, warmup_steps=2, averager="hierarchical")),
        "default_subgroup": error_of(lambda: overlapkit.post_local_sgd(
            second, _sgd(second), period=4, warmup_steps=2)),
        "straddling_plan": error_of(lambda: overlapkit.create_averager(
            "hierarchical", period_group_size_dict={2: 3, 4: world_size})),
        "node_period_too_large": error_of(lambda: overlapkit.create_averager(
            "hierarchical", period=4, node_period=4)),
        "both_plans": error_of(lambda: overlapkit.create_averager(
            "hierarchical", period=4, node_period=2, period_group_size_dict={4: world_size})),
    }
    # every rank is still in step: a collective completes
    flag = torch.ones(1)
    dist.all_reduce(flag)
    out["in_step"] = int(flag.item())
    return out


def reshard_local_sgd_state(rank: int, world_size: int, saved: dict[str, Any],
                            during_warmup: dict[str, Any]) -> dict[str, Any]:
    """Load post-local SGD state saved by another number of ranks: refused after local
    steps began (each rank's own), loaded during warm-up."""
    model = make_ddp()
    opt = overlapkit.post_local_sgd(model, _sgd(model), period=2, warmup_steps=3,
                                    subgroup_size=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out: dict[str, Any] = {"after_warmup": error_of(lambda: opt.load_state_dict(saved)),
                           "averager_step": opt.averager.step}
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    opt.load_state_dict(during_warmup)
    out["during_warmup_step"] = opt.averager.step
    return out


def local_sgd_states(rank: int, world_size: int) -> dict[str, Any]:
    """Post-local SGD's state dict (warm-up 3, period 2) during warm-up (after 2 steps)
    and after local steps began (after 6)."""
    model = make_ddp()
    opt = overlapkit.post_local_sgd(model, _sgd(model), period=2, warmup_steps=3,
                                    subgroup_size=1)
    train(model, opt, rank, 2)
    during_warmup = opt.state_dict()
    train(model, opt, rank, 4)
    return {"during_warmup": during_warmup, "after_warmup": opt.state_dict()}
