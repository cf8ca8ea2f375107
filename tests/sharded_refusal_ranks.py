"""The rank side of the refusals in tests/test_sharded_state.py: bad input to
``overlap_ddp(..., shard_optimizer_state=True)`` refused before anything changes, the
state-dict rules, and ``add_param_group`` on a sharded optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, values
from sharded_state_ranks import LR, _loss, batches, build, build_reference
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

# -- item 6: bad input, refused before anything changes --------------------------------

class GroupWriter(torch.optim.SGD):
    """Writes a value computed from every parameter into its group (as D-Adaptation's
    ``d``)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            group["d"] = sum(float(p.grad.abs().sum()) for p in group["params"]
                             if p.grad is not None and p.device.type != "meta")
        return super().step(closure)


class SharedState(torch.optim.SGD):
    """Keeps state under a key that is no parameter."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.state["global"]["steps"] = self.state["global"].get("steps", 0) + 1
        return super().step(closure)


class RankDependent(overlapkit.ShardingPolicy):
    def assign(self, params: Any, world_size: int, *, loads: Any) -> list[int]:
        return [dist.get_rank()] * len(params)


class WrongLength(overlapkit.ShardingPolicy):
    def assign(self, params: Any, world_size: int, *, loads: Any) -> list[int]:
        return [0]


class OutOfRange(overlapkit.ShardingPolicy):
    def assign(self, params: Any, world_size: int, *, loads: Any) -> list[int]:
        return [world_size] * len(params)


REFUSED_SETUPS: dict[str, tuple[Callable[[], DDP], type[torch.optim.Optimizer],
                                dict[str, Any]]] = {
    "find_unused_parameters": (lambda: build(find_unused_parameters=True),
                               torch.optim.AdamW, {}),
    "step_thread='comm'": (build, torch.optim.AdamW, {"step_thread": "comm"}),
    "clip_grad_norm_scope='bucket'": (build, torch.optim.AdamW, {
        "clip_grad_norm": 1.0, "clip_grad_norm_scope": "bucket"}),
    "LBFGS": (build, torch.optim.LBFGS, {}),
    "an optimizer writing into its param groups": (build, GroupWriter, {}),
    "an optimizer with state that is no parameter's": (build, SharedState, {}),
    "a policy answering per rank": (build, torch.optim.AdamW,
                                    {"shard_optimizer_state": RankDependent()}),
    "a policy answering too few owners": (build, torch.optim.AdamW,
                                          {"shard_optimizer_state": WrongLength()}),
    "a policy answering a rank out of range": (build, torch.optim.AdamW,
                                               {"shard_optimizer_state": OutOfRange()}),
    "shard_optimizer_state='yes'": (build, torch.optim.AdamW,
                                    {"shard_optimizer_state": "yes"}),
    "shard_optimizer_state=the policy class": (
        build, torch.optim.AdamW, {"shard_optimizer_state": overlapkit.SizeBalancedPolicy}),
}


def refusals(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (make, cls, options) in REFUSED_SETUPS.items():
        ddp = make()
        options = {"shard_optimizer_state": True, **options}
        lr = {"lr": LR} if cls is not torch.optim.LBFGS else {}
        error = error_of(lambda: overlapkit.overlap_ddp(ddp, cls, **lr, **options))  # noqa: B023
        # nothing changed: the model takes overlap_ddp (a comm hook, the parameters)
        unchanged = error_of(lambda: overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR))  # noqa: B023
        out[name] = {"error": error, "unchanged": unchanged is None,
                     "after": unchanged}
    out["state dicts"] = _state_dict_refusals(rank, world_size)
    out["added group"] = added_group(rank, world_size)
    return out


def _state_dict_refusals(rank: int, world_size: int) -> dict[str, Any]:
    ddp = build()
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR, shard_optimizer_state=True)

    def step(tokens: torch.Tensor) -> None:
        _loss(ddp, tokens).backward()
        opt.step()
        opt.zero_grad()

    data = batches(rank)
    step(data[0])
    out: dict[str, Any] = {"not gathered": error_of(opt.state_dict)}
    opt.consolidate_state_dict(to=0)
    out["gathered here"] = error_of(opt.state_dict) if rank == 0 else None
    out["gathered elsewhere"] = error_of(opt.state_dict) if rank != 0 else None
    step(data[1])
    out["stale"] = error_of(opt.state_dict) if rank == 0 else None
    out["bad rank"] = error_of(lambda: opt.consolidate_state_dict(to=world_size))
    local = opt.local_state_dict()
    others: list[Any] = [None] * world_size
    dist.all_gather_object(others, local)
    before = {id(p): {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
              for p, s in opt.optimizer.state.items()}
    out["another rank's share"] = error_of(
        lambda: opt.load_state_dict(others[(rank + 1) % world_size]))
    after = {id(p): {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
             for p, s in opt.optimizer.state.items()}
    out["state unchanged"] = before.keys() == after.keys() and all(
        torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])
    out["own share"] = error_of(lambda: opt.load_state_dict(local))
    out["not a state dict"] = error_of(lambda: opt.load_state_dict({"weights": 1}))
    out["plain optimizer refuses a share"] = error_of(
        lambda: torch.optim.AdamW(build().parameters()).load_state_dict(local))
    return out


# -- add_param_group: the new parameters assigned against what each rank owns ----------

def added_group(rank: int, world_size: int) -> dict[str, Any]:
    """The optimizer built on the weights; the biases and norms added as a second group
    before training (a plain optimizer the same way)."""
    out = {}
    for sharded in (False, True):
        ddp = build() if sharded else build_reference()
        named = list(ddp.module.named_parameters())
        weights = [p for n, p in named if p.ndim > 1]
        others = [p for n, p in named if p.ndim <= 1]
        if sharded:
            opt: Any = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, params=weights, lr=LR,
                                              shard_optimizer_state=True)
        else:
            opt = torch.optim.AdamW(weights, lr=LR)
        opt.add_param_group({"params": others, "lr": LR / 2, "weight_decay": 0.0})
        for tokens in batches(rank):
            _loss(ddp, tokens).backward()
            opt.step()
            opt.zero_grad()
        out[sharded] = values(ddp)
        if sharded:
            out["owners"] = list(opt.ownership.owners)
            out["loads"] = opt.ownership.loads()
            out["held"] = {id(p) for p in opt.optimizer.state} == opt.local_state_params()
    return {"values": compare(out[False], out[True]), "owners": out["owners"],
            "loads": out["loads"], "held": out["held"]}
