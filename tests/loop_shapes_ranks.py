"""The rank side of tests/test_loop_shapes.py: the three loop shapes around an optimizer
that steps in backward, on every kind of model, against the plain loop (backward,
``step()``, ``zero_grad()`` each iteration), on 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 4
LR = 0.01
CLIP = 0.05  # small enough to clip at every step

#: how each kind of model is built: name -> (wrap, DDP options)
DDP_KINDS: dict[str, dict[str, Any]] = {
    "ddp": {},
    "ddp bucket_view": {"gradient_as_bucket_view": True},
    "ddp static_graph": {"static_graph": True},
    "ddp bucket_view static_graph": {"gradient_as_bucket_view": True, "static_graph": True},
}
KINDS = (*DDP_KINDS, "fsdp2", "module")
#: the loop shapes of overlapkit.overlap.core.step_accounting
LOOPS = ("backward only", "backward + scheduler", "backward + step + zero_grad")
#: what the set-up adds: nothing, global clipping, a GradScaler (its loop calls
#: scaler.step(opt), so it is always the third shape)
OPTIONS = ("none", "clip", "scaler")


class Net(nn.Module):
    """A small model with what users' models have: an embedding, a norm, biases."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.embed(tokens).mean(dim=1))
        return self.head(torch.tanh(self.fc(hidden)))


def batches(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, 32, (8, 6), generator=generator) for _ in range(STEPS)]


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    if kind in DDP_KINDS:
        return DDP(model, bucket_cap_mb=0.001, **DDP_KINDS[kind])
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model.embed, model.fc, model.head):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def techniques(kind: str) -> tuple[str, ...]:
    return ("overlap_ddp", "optimizer_in_backward") if kind in DDP_KINDS \
        else ("optimizer_in_backward",)


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def train(kind: str, technique: str | None, loop: str, option: str,
          rank: int) -> dict[str, Any]:
    """Train ``STEPS`` iterations; ``technique`` None is the plain loop."""
    model = build(kind)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if option == "scaler" else None
    if technique is None:
        opt: Any = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        setup: dict[str, Any] = {}
        if option == "clip":
            setup["clip_grad_norm"] = CLIP
        if scaler is not None:
            setup["grad_scaler"] = scaler
        opt = getattr(overlapkit, technique)(model, torch.optim.AdamW, lr=LR, **setup)
    scheduler = _schedule(opt) if loop != "backward only" else None
    for tokens in batches(rank):
        loss = model(tokens).square().mean()
        if technique is None:  # the plain loop
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                if option == "clip":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
            opt.zero_grad()
        elif scaler is not None:  # the AMP loop, unchanged
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        else:
            loss.backward()
            if loop == "backward + step + zero_grad":
                opt.step()
                opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return {"values": values(model), "state": state_tensors(opt)}


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors in parameter order (full tensors of DTensors): the
    state dict's insertion order is the order of the first steps, which differs."""
    out = []
    for group in opt.param_groups:
        for param in group["params"]:
            for value in opt.state.get(param, {}).values():
                if isinstance(value, torch.Tensor):
                    full = getattr(value, "full_tensor", None)
                    out.append(full() if callable(full) else value)
    return out


def cases() -> list[tuple[str, str, str, str]]:
    """(kind, technique, loop, option) of every case."""
    out = []
    for kind in KINDS:
        for technique in techniques(kind):
            for option in OPTIONS:
                loops = LOOPS[2:] if option == "scaler" else LOOPS
                out.extend((kind, technique, loop, option) for loop in loops)
    return out


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plain: dict[tuple[str, bool, str], dict[str, Any]] = {}
    start = values(build("module"))
    for kind, technique, loop, option in cases():
        key = (kind, loop == "backward only", option)
        if key not in plain:
            plain[key] = train(kind, None, "backward only" if key[1] else
                               "backward + step + zero_grad", option, rank)
        ours = train(kind, technique, loop, option, rank)
        out[f"{kind} | {technique} | {loop} | {option}"] = {
            "values": compare(plain[key]["values"], ours["values"]),
            "state": compare(plain[key]["state"], ours["state"]),
            "trained": not compare(start, ours["values"]),
        }
    return out
