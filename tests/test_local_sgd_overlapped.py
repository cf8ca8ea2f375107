"""PostLocalSGDOptimizer over ``overlap_ddp(..., comm_hook="post_local_sgd")`` on 2 gloo
ranks: the comm hook's warm-up counter is saved and restored, so a resumed run is
bitwise the uninterrupted one (9b5962c: the optimizer did not know the hook's state,
nothing to pass as comm_hook_state; the resumed hook re-ran warm-up, 0.0033 off after
10 steps, silently)."""

from __future__ import annotations

import io
import warnings
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.distributed import run_distributed

WARMUP, PERIOD, STEPS, SAVE_AT = 3, 3, 10, 4


def _set_up() -> tuple[DDP, overlapkit.PostLocalSGDOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    ddp = DDP(model, bucket_cap_mb=0.0002)
    local = overlapkit.overlap_ddp(ddp, torch.optim.SGD, lr=0.1, comm_hook="post_local_sgd",
                                   comm_hook_options={"start_localSGD_iter": WARMUP,
                                                      "subgroup_size": 1})
    averager = overlapkit.create_averager("periodic", period=PERIOD, warmup_steps=WARMUP)
    return ddp, overlapkit.PostLocalSGDOptimizer(local, averager)


def _train(ddp: DDP, opt: torch.optim.Optimizer, rank: int, steps: range) -> torch.Tensor:
    for step in steps:
        gen = torch.Generator().manual_seed(10 * rank + step)
        x, y = torch.randn(3, 4, generator=gen), torch.randn(3, 2, generator=gen)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).clone()


def _resume(rank: int, world_size: int) -> dict[str, Any]:
    uninterrupted = _train(*_set_up(), rank, range(STEPS))
    ddp, opt = _set_up()
    _train(ddp, opt, rank, range(SAVE_AT))
    buffer = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    ddp, opt = _set_up()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        resumed = _train(ddp, opt, rank, range(SAVE_AT, STEPS))
    return {"uninterrupted": uninterrupted, "resumed": resumed,
            "saved keys": sorted(saved["optimizer"]), "warnings": [str(w.message) for w in caught]}


def test_resume_under_overlap_ddp_with_the_post_local_sgd_hook_is_exact() -> None:
    for rank, result in enumerate(run_distributed(_resume, 2, timeout=120)):
        assert "comm_hook" in result["saved keys"], result["saved keys"]
        difference = float((result["uninterrupted"] - result["resumed"]).abs().max())
        assert difference == 0.0, f"rank {rank}: {difference}"
        assert result["warnings"] == []
