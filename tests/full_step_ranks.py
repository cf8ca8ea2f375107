"""The rank side of tests/test_full_step.py: a ``step()`` after backwards that stepped
nothing (only ``no_sync()`` / ``no_step()`` backwards) applies everything a step in
backward applies — value and norm clipping, a GradScaler's unscale, inf check and skip —
bitwise the plain loop, on 2 gloo ranks."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from helpers import compare, rank_batches, shard_linears, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS, MICRO = 4, 2
#: the step at which rank 1's micro-batch overflows (a synchronised backward: every
#: rank skips it), before steps that see only no_sync() backwards
OVERFLOW_STEP = 1


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 32),
                         nn.Tanh(), nn.Linear(32, 4))


def _fsdp2() -> nn.Module:
    return shard_linears(_net())


#: name -> (model, technique, options)
SETUPS: dict[str, tuple[Callable[[], nn.Module], str, dict[str, Any]]] = {
    "overlap_ddp clip_grad_norm": (lambda: DDP(_net(), bucket_cap_mb=0.001), "overlap_ddp",
                                   {"clip_grad_norm": 0.1}),
    "overlap_ddp clip_grad_value": (lambda: DDP(_net(), bucket_cap_mb=0.001), "overlap_ddp",
                                    {"clip_grad_value": 0.01}),
    "overlap_ddp bucket-scope clip": (
        lambda: DDP(_net(), bucket_cap_mb=0.001), "overlap_ddp",
        {"clip_grad_norm": 0.1, "clip_grad_norm_scope": "bucket"}),
    "overlap_ddp grad_scaler": (lambda: DDP(_net(), bucket_cap_mb=0.001), "overlap_ddp",
                                {"grad_scaler": True, "clip_grad_norm": 0.1}),
    "optimizer_in_backward ddp clip": (
        lambda: DDP(_net(), bucket_cap_mb=0.001), "optimizer_in_backward",
        {"clip_grad_norm": 0.1, "clip_grad_value": 0.05}),
    "optimizer_in_backward ddp grad_scaler": (
        lambda: DDP(_net(), bucket_cap_mb=0.001), "optimizer_in_backward",
        {"grad_scaler": True}),
    "optimizer_in_backward module clip": (_net, "optimizer_in_backward",
                                          {"clip_grad_norm": 0.1}),
    "optimizer_in_backward module grad_scaler": (_net, "optimizer_in_backward",
                                                 {"grad_scaler": True, "clip_grad_norm": 0.1}),
    "optimizer_in_backward fsdp2 clip": (_fsdp2, "optimizer_in_backward",
                                         {"clip_grad_norm": 0.1}),
}


def _accumulating(model: nn.Module, opt: Any) -> AbstractContextManager[Any]:
    if isinstance(model, DDP):
        return model.no_sync()
    if hasattr(opt, "no_step"):
        return opt.no_step()  # type: ignore[no-any-return]
    return _Nothing()  # the plain loop on a module or FSDP2: gradients accumulate


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def train(build: Callable[[], nn.Module], technique: str | None, options: dict[str, Any],
          rank: int) -> dict[str, Any]:
    """Every optimizer step sees only accumulating backwards (``no_sync()`` /
    ``no_step()``) except at :data:`OVERFLOW_STEP`, whose last backward is synchronised
    (with a scaler, rank 1's loss overflows there, so every rank skips it)."""
    model = build()
    scaler = (torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
              if options.get("grad_scaler") else None)
    setup = {k: v for k, v in options.items() if k != "grad_scaler"}
    if technique is None:
        opt: Any = torch.optim.AdamW(model.parameters(), lr=0.01)
    else:
        opt = getattr(overlapkit, technique)(model, torch.optim.AdamW, lr=0.01,
                                             grad_scaler=scaler, **setup)
    batches = rank_batches(rank, STEPS * MICRO)
    scales = []
    for step in range(STEPS):
        for micro in range(MICRO):
            x = batches[step * MICRO + micro]
            synced = step == OVERFLOW_STEP and micro == MICRO - 1
            if synced and scaler is not None and rank == 1:
                x = x * 3e38
            with _Nothing() if synced else _accumulating(model, opt):
                loss = model(x).square().mean()  # DDP's no_sync() covers the forward
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if technique is None and scaler is not None:
            scaler.unscale_(opt)
        if technique is None:
            if "clip_grad_value" in options:
                torch.nn.utils.clip_grad_value_(model.parameters(), options["clip_grad_value"])
            if "clip_grad_norm" in options:
                torch.nn.utils.clip_grad_norm_(model.parameters(), options["clip_grad_norm"])
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
        opt.zero_grad()
    return {"values": values(model), "scales": scales}


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (build, technique, options) in SETUPS.items():
        plain_options = dict(options)
        if plain_options.get("clip_grad_norm_scope") == "bucket":
            plain_options.pop("clip_grad_norm_scope")  # a full step clips globally
        plain = train(build, None, plain_options, rank)
        ours = train(build, technique, options, rank)
        out[name] = {"values": compare(plain["values"], ours["values"]),
                     "scales": (plain["scales"], ours["scales"])}
    return out
