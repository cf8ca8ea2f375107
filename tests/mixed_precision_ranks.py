"""The rank side of tests/test_mixed_precision.py: the fp16 AMP loop with a GradScaler
(an overflow on one rank at one step), and bf16 parameters, against plain DDP."""

from __future__ import annotations

from typing import Any

import torch
from helpers import compare, rank_batches, shard_linears, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS, OVERFLOW_STEP = 5, 2
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01}),
}
SETUPS = {
    "overlap_ddp": lambda ddp, cls, kw, scaler: overlapkit.overlap_ddp(
        ddp, cls, grad_scaler=scaler, clip_grad_norm=1.0, **kw),
    "overlap_ddp comm": lambda ddp, cls, kw, scaler: overlapkit.overlap_ddp(
        ddp, cls, grad_scaler=scaler, clip_grad_norm=1.0, step_thread="comm", **kw),
    "optimizer_in_backward": lambda ddp, cls, kw, scaler: overlapkit.optimizer_in_backward(
        ddp, cls, grad_scaler=scaler, clip_grad_norm=1.0, **kw),
}


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4)).to(dtype)


def _amp_loop(model: nn.Module, opt: Any, scaler: Any, rank: int, *,
              plain: bool) -> dict[str, Any]:
    scales, skipped = [], []
    for step, x in enumerate(rank_batches(rank, STEPS)):
        if step == OVERFLOW_STEP and rank == 1:
            x = x * 3e38  # this rank's loss overflows: every rank must skip the step
        before = values(model)
        scaler.scale(model(x).square().mean()).backward()
        if plain:  # the PyTorch AMP loop with clipping
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        skipped.append(bool(compare(before, values(model))))
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"values": values(model), "scales": scales, "skipped": skipped, "state": state}


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        ddp = DDP(_model(), bucket_cap_mb=0.001)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
        plain = _amp_loop(ddp, cls(ddp.parameters(), **kwargs), scaler, rank, plain=True)
        out[f"plain {name} skipped"] = plain["skipped"]
        for setup, make in SETUPS.items():
            ddp = DDP(_model(), bucket_cap_mb=0.001)
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
            ours = _amp_loop(ddp, make(ddp, cls, kwargs, scaler), scaler, rank, plain=False)
            out[f"{setup} {name}"] = {
                "values": compare(plain["values"], ours["values"]),
                "state": compare(plain["state"], ours["state"]),
                "scales": (plain["scales"], ours["scales"]),
                "skipped": (plain["skipped"], ours["skipped"]),
            }
    out.update(_fsdp2(rank))
    for dtype in (torch.bfloat16, torch.float16):  # low-precision parameters
        for setup in ("overlap_ddp", "optimizer_in_backward"):
            runs = []
            for overlapped in (False, True):
                ddp = DDP(_model(dtype), bucket_cap_mb=0.001)
                opt: Any = (getattr(overlapkit, setup)(ddp, torch.optim.AdamW, lr=0.01,
                                                        eps=1e-4)
                            if overlapped else
                            torch.optim.AdamW(ddp.parameters(), lr=0.01, eps=1e-4))
                for x in rank_batches(rank, STEPS):
                    ddp(x.to(dtype)).float().square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                runs.append(values(ddp.module) + [t for s in opt.state.values()
                                                  for t in s.values()])
            name = "bf16" if dtype is torch.bfloat16 else "fp16"
            out[f"{name} {setup}"] = compare(*runs)
            out[f"{name} {setup} moved"] = not compare(values(_model(dtype)), runs[0][:6])
    return out


def _fsdp2_model() -> nn.Module:
    return shard_linears(_model())


def _fsdp2(rank: int) -> dict[str, Any]:
    """optimizer_in_backward on FSDP2 with grad_scaler= and global clipping against
    plain FSDP2 + the same scaler + clip_grad_norm_ (DTensor gradients)."""
    out: dict[str, Any] = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        runs = []
        for overlapped in (False, True):
            model = _fsdp2_model()
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
            opt: Any = (overlapkit.optimizer_in_backward(model, cls, grad_scaler=scaler,
                                                         clip_grad_norm=1.0, **kwargs)
                        if overlapped else cls(model.parameters(), **kwargs))
            runs.append(_amp_loop(model, opt, scaler, rank, plain=not overlapped))
        out[f"fsdp2 {name}"] = {
            "values": compare(runs[0]["values"], runs[1]["values"]),
            "state": compare([t.full_tensor() if hasattr(t, "full_tensor") else t
                              for t in runs[0]["state"]],
                             [t.full_tensor() if hasattr(t, "full_tensor") else t
                              for t in runs[1]["state"]]),
            "scales": (runs[0]["scales"], runs[1]["scales"]),
            "skipped": (runs[0]["skipped"], runs[1]["skipped"]),
        }
    return out
