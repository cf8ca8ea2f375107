"""The rank side of tests/test_works_with.py: the rows of the technique pages' "Works
with" tables that no other test covers — bf16 autocast under every technique, and
post-local SGD on a torch.compile'd module and with a GradScaler — each against the
plain PyTorch run it stands in for (2 gloo ranks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS, WARMUP, PERIOD, LR = 6, 2, 2, 0.01


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _train(ddp: nn.Module, opt: Any, rank: int, *, autocast: bool = False,
           scaler: torch.amp.GradScaler | None = None) -> list[torch.Tensor]:
    for x in rank_batches(rank, STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = ddp(x).float().square().mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return values(ddp)


def _autocast(rank: int) -> dict[str, Any]:
    """overlap_ddp and optimizer_in_backward under bf16 autocast: plain DDP's bits."""
    plain = DDP(model(), bucket_cap_mb=0.001)
    expected = _train(plain, torch.optim.AdamW(plain.parameters(), lr=LR), rank,
                      autocast=True)
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        ddp = DDP(model(), bucket_cap_mb=0.001)
        opt = getattr(overlapkit, technique)(ddp, torch.optim.AdamW, lr=LR)
        out[f"{technique} autocast"] = compare(expected, _train(ddp, opt, rank,
                                                                autocast=True))
    return out


def _torch_post_local_sgd(ddp: DDP) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    subgroup, _ = dist.new_subgroups(group_size=1)
    ddp.register_comm_hook(
        PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=WARMUP),
        post_localSGD_hook)
    return PostLocalSGDOptimizer(torch.optim.AdamW(ddp.parameters(), lr=LR),
                                 PeriodicModelAverager(period=PERIOD, warmup_steps=WARMUP))


def _ours_post_local_sgd(ddp: DDP) -> Any:
    return overlapkit.post_local_sgd(ddp, torch.optim.AdamW(ddp.parameters(), lr=LR),
                                     period=PERIOD, warmup_steps=WARMUP, subgroup_size=1)


def _post_local_sgd(rank: int) -> dict[str, Any]:
    """post_local_sgd against torch's PostLocalSGDOptimizer under bf16 autocast, on a
    torch.compile'd module (``aot_eager``: no C++ toolchain) and with a GradScaler."""
    cases: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
        "post_local_sgd autocast": (model, {"autocast": True}),
        "post_local_sgd compiled": (
            lambda: torch.compile(model(), backend="aot_eager"), {}),
        "post_local_sgd GradScaler": (model, {"autocast": True, "scaler": True}),
    }
    out: dict[str, Any] = {}
    for case, (build, options) in cases.items():
        torch._dynamo.reset()
        runs = []
        for setup in (_torch_post_local_sgd, _ours_post_local_sgd):
            # dynamo's DDPOptimizer wants DDP's default first bucket: no bucket_cap_mb
            ddp = (DDP(build()) if case.endswith("compiled")
                   else DDP(build(), bucket_cap_mb=0.001))
            opt = setup(ddp)
            scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**8)
                      if options.get("scaler") else None)
            runs.append(_train(ddp, opt, rank, autocast=options.get("autocast", False),
                               scaler=scaler))
        out[case] = compare(*runs)
    return out


def run(rank: int, world_size: int) -> dict[str, Any]:
    out = {**_autocast(rank), **_post_local_sgd(rank)}
    dist.barrier()
    return out
