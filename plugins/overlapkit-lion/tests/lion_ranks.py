"""What each rank runs for test_lion_overlap.py."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit_lion import Lion

STEPS = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
        torch.nn.Linear(32, 4),
    )


def _train(rank: int, overlapped: bool, **lion: Any) -> tuple[torch.Tensor, Any, str]:
    ddp = DDP(_model(), bucket_cap_mb=0.002)  # several buckets
    if overlapped:
        opt = overlapkit.overlap_ddp(ddp, Lion, lr=1e-3, **lion)
        engine = type(opt.engine).__name__
    else:
        opt = Lion(ddp.parameters(), lr=1e-3, **lion)
        engine = "none"
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 4, generator=gen)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).clone()
    if overlapped:  # how many buffers hold the momenta: fewer than tensors when flat
        storages = {opt.state[p]["exp_avg"].untyped_storage().data_ptr()
                    for p in ddp.parameters()}
        engine += f" ({len(storages)} momentum buffers)"
    return params, opt.state_dict(), engine


def run_all(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for decay in (0.0, 0.1):
        plain, plain_state, _ = _train(rank, False, weight_decay=decay)
        ours, our_state, engine = _train(rank, True, weight_decay=decay)
        results[decay] = {"plain": plain, "ours": ours, "engine": engine,
                          "plain_state": plain_state, "our_state": our_state}
    # The overlapped optimizer's state_dict loads into a plain Lion and vice versa.
    model = _model()
    plain_lion = Lion(model.parameters(), lr=1e-3)
    plain_lion.load_state_dict(results[0.1]["our_state"])
    results["loads_into_plain"] = plain_lion.state_dict()["state"][0]["exp_avg"]
    return results


def engine_when_blocked(rank: int, world_size: int) -> dict[str, Any]:
    plain, _, _ = _train(rank, False)
    ours, _, engine = _train(rank, True)
    return {"plain": plain, "ours": ours, "engine": engine}


def sharded(rank: int, world_size: int) -> dict[str, Any]:
    """Lion through overlap_ddp with sharded optimizer state (each rank keeps the momenta
    of its share), against plain Lion; the plugin's engine steps the share."""
    plain, plain_state, _ = _train(rank, False, weight_decay=0.1)
    ddp = DDP(_model(), bucket_cap_mb=0.002)
    opt = overlapkit.overlap_ddp(ddp, Lion, lr=1e-3, weight_decay=0.1,
                                 shard_optimizer_state=True)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 4, generator=gen)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).clone()
    opt.consolidate_state_dict(to=0)
    return {"plain": plain, "ours": params, "engine": type(opt.engine).__name__,
            "plain_state": plain_state, "our_state": opt.state_dict() if rank == 0 else None,
            "held": len(opt.optimizer.state), "owned": len(opt.owned_parameters())}
