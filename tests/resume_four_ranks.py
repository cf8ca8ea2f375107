"""The rank side of tests/test_resume_four_ranks.py: on four ranks, where the order in
which the ranks' gradients are added depends on DDP's bucket layout, a run saved in
the middle and resumed into a fresh model ends bitwise where the uninterrupted run
ends (overlapkit.checkpoint.ddp_buckets), with plain DDP and torch's AdamW and with each
overlapped optimizer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import compare, named_values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.checkpoint.ddp_buckets import LAYOUT_FILE, replay_layout

STEPS, SAVE_AT = 6, 3


class OutOfOrder(nn.Module):
    """Layers registered in another order than the forward uses them, a weight shared
    by two layers, LayerNorm, a frozen layer and an integer buffer: the backward
    produces the gradients in an order of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(32, 16)
        self.norm = nn.LayerNorm(32)
        self.embed = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 32)
        self.again = nn.Linear(32, 32)
        self.again.weight = self.mid.weight  # shared
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        hidden = F.gelu(self.embed(self.frozen(x)))
        hidden = self.norm(hidden + F.gelu(self.mid(hidden)))
        hidden = hidden + 0.5 * self.again(hidden)
        return self.head(hidden)


def _build(kind: str, seed: int = 0) -> DDP:
    torch.manual_seed(seed)
    if kind == "readme":  # the README script's model and buckets
        return DDP(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)))
    # several buckets; their memory is the gradients' own in "bucket-views"
    return DDP(OutOfOrder(), bucket_cap_mb=0.004,
               gradient_as_bucket_view=kind == "bucket-views")


def _optimizer(technique: str, model: DDP) -> Any:
    if technique == "plain":
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    if technique == "sharded":
        return overlapkit.overlap_ddp(model, torch.optim.AdamW, lr=0.01, weight_decay=0.01,
                                      shard_optimizer_state=True)
    if technique == "clipped":  # the README's: global norm clipping
        return overlapkit.overlap_ddp(model, torch.optim.AdamW, lr=0.01, weight_decay=0.01,
                                      clip_grad_norm=1.0)
    return getattr(overlapkit, technique)(model, torch.optim.AdamW, lr=0.01,
                                          weight_decay=0.01)


def _steps(kind: str, model: DDP, opt: Any, rank: int, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 16, generator=generator)
        target = x.sum(dim=1, keepdim=True).sin()
        out = model(x)
        F.mse_loss(out if kind == "readme" else out.sum(1, keepdim=True), target).backward()
        opt.step()
        opt.zero_grad()


def _resumed_by_torch(kind: str, rank: int) -> dict[str, torch.Tensor]:
    """Plain DDP resumed through torch's own load_state_dict (no layout): the first
    step after it adds the gradients in DDP's first layout."""
    model = _build(kind)
    opt = _optimizer("plain", model)
    _steps(kind, model, opt, rank, range(SAVE_AT))
    states = model.state_dict(), opt.state_dict()
    fresh = _build(kind, seed=7)
    fresh_opt = _optimizer("plain", fresh)
    fresh.load_state_dict(states[0])
    fresh_opt.load_state_dict(states[1])
    _steps(kind, fresh, fresh_opt, rank, range(SAVE_AT, STEPS))
    return named_values(fresh.module)


def _resumed(kind: str, technique: str, rank: int, directory: str) -> dict[str, Any]:
    model = _build(kind)
    opt = _optimizer(technique, model)
    _steps(kind, model, opt, rank, range(SAVE_AT))
    path = os.path.join(directory, f"{kind}-{technique}")
    overlapkit.checkpoint.save(path, model, opt)
    fresh = _build(kind, seed=7)
    fresh_opt = _optimizer(technique, fresh)
    for param in fresh.parameters():
        param.grad = torch.full_like(param, 3.0)
    overlapkit.checkpoint.load(path, fresh, fresh_opt)
    # as they were (with gradient_as_bucket_view, DDP moves them into its new buckets)
    kept = all(p.grad is not None and bool((p.grad == 3.0).all()) for p in fresh.parameters())
    fresh_opt.zero_grad()
    # saved again at once, before any backward: the layout goes on with it
    again = os.path.join(directory, f"{kind}-{technique}-again")
    overlapkit.checkpoint.save(again, fresh, fresh_opt)
    _steps(kind, fresh, fresh_opt, rank, range(SAVE_AT, STEPS))
    return {"values": named_values(fresh.module), "grads kept": kept,
            "layout saved": os.path.isfile(os.path.join(path, LAYOUT_FILE)),
            "layout saved again": os.path.isfile(os.path.join(again, LAYOUT_FILE))}


def _kept_as_ddp_lays_them(directory: str) -> dict[str, Any]:
    """Where DDP's own layout is kept, the saved one is not replayed (and nothing else
    changes): DDP settings whose first backward is special, another library's comm
    hook (stateful: PowerSGD; torch's stateless allreduce_hook is replayed), no_sync(),
    a model DDP already laid out again."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    path = Path(directory) / "out-of-order-overlap_ddp"
    out: dict[str, Any] = {}

    def fresh(**options: Any) -> DDP:
        torch.manual_seed(0)
        return DDP(OutOfOrder(), bucket_cap_mb=0.004, **options)

    for name, options in (("find_unused_parameters", {"find_unused_parameters": True}),
                          ("static_graph", {"static_graph": True})):
        out[name] = replay_layout(path, fresh(**options))
    model = fresh()
    state = powersgd.PowerSGDState(process_group=None, start_powerSGD_iter=2)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    out["PowerSGD"] = (replay_layout(path, model), state.iter)
    model = fresh()
    model.register_comm_hook(None, default_hooks.allreduce_hook)  # stateless: replayed
    out["torch's allreduce_hook"] = replay_layout(path, model)
    model = fresh()
    with model.no_sync():
        out["no_sync"] = replay_layout(path, model)
    model = fresh()
    with torch.no_grad():  # a load under no_grad() replays all the same
        out["laid out"] = replay_layout(path, model)
    out["laid out again"] = replay_layout(path, model)
    out["not DDP"] = replay_layout(path, OutOfOrder())
    return out


def run(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("readme", "out-of-order", "bucket-views"):
        for technique in ("plain", "overlap_ddp", "clipped", "optimizer_in_backward",
                          "sharded"):
            model = _build(kind)
            opt = _optimizer(technique, model)
            _steps(kind, model, opt, rank, range(STEPS))
            uninterrupted = named_values(model.module)
            resumed = _resumed(kind, technique, rank, directory)
            key = f"{kind} {technique}"
            out[key] = compare(uninterrupted, resumed["values"])
            out[f"{key} grads kept"] = resumed["grads kept"]
            out[f"{key} layout saved"] = resumed["layout saved"]
            out[f"{key} layout saved again"] = resumed["layout saved again"]
            if technique == "plain":
                out[f"{kind} torch's load"] = compare(uninterrupted,
                                                     _resumed_by_torch(kind, rank))
    out["kept"] = _kept_as_ddp_lays_them(directory)
    dist.barrier()
    return out
