"""The rank side of tests/test_clip_order.py: global-norm clipping with param groups
that are not in model order (the usual no-decay/decay split, biases first), against
``clip_grad_norm_(model.parameters(), max_norm)`` in the plain loop, on 2 gloo ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from helpers import compare, rank_batches, shard_linears, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 6
CLIP = 0.1


def _net() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 48)]
    for _ in range(6):
        layers += [nn.LayerNorm(48), nn.Tanh(), nn.Linear(48, 48)]
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(48, 4))


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """What users build from named_parameters(): biases and norms without weight decay
    first, then the weights."""
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.1}]


def _fsdp2() -> nn.Module:
    return shard_linears(_net())


#: name -> (build the model, make the overlapped optimizer, DDP comm hook of the plain run)
SETUPS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], Any], str | None]] = {
    "overlap_ddp": (lambda: DDP(_net(), bucket_cap_mb=0.001), lambda m: overlapkit.overlap_ddp(
        m, torch.optim.AdamW, params=_groups(m.module), lr=0.01, clip_grad_norm=CLIP), None),
    "overlap_ddp fp16_compress": (
        lambda: DDP(_net(), bucket_cap_mb=0.001), lambda m: overlapkit.overlap_ddp(
            m, torch.optim.AdamW, params=_groups(m.module), lr=0.01, clip_grad_norm=CLIP,
            comm_hook="fp16_compress"), "fp16_compress"),
    "optimizer_in_backward ddp": (
        lambda: DDP(_net(), bucket_cap_mb=0.001), lambda m: overlapkit.optimizer_in_backward(
            m, torch.optim.AdamW, params=_groups(m.module), lr=0.01, clip_grad_norm=CLIP),
        None),
    "optimizer_in_backward fsdp2": (_fsdp2, lambda m: overlapkit.optimizer_in_backward(
        m, torch.optim.AdamW, params=_groups(m), lr=0.01, clip_grad_norm=CLIP), None),
    "optimizer_in_backward module": (_net, lambda m: overlapkit.optimizer_in_backward(
        m, torch.optim.AdamW, params=_groups(m), lr=0.01, clip_grad_norm=CLIP), None),
}


def _plain(build: Callable[[], nn.Module], hook: str | None, rank: int) -> list[torch.Tensor]:
    model = build()
    inner = model.module if isinstance(model, DDP) else model
    if hook is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        assert isinstance(model, DDP)
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.AdamW(_groups(inner), lr=0.01)
    for x in rank_batches(rank, STEPS):
        model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return values(model)


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (build, make, hook) in SETUPS.items():
        expected = _plain(build, hook, rank)
        model = build()
        opt = make(model)
        for x in rank_batches(rank, STEPS):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out[name] = compare(expected, values(model))
    return out
