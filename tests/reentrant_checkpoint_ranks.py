"""The rank side of tests/test_reentrant_checkpoint.py: models with reentrant activation
checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``, the default of older
Hugging Face ``gradient_checkpointing_enable``), whose recomputation runs a nested
backward, trained by each technique against the plain loop on 2 gloo ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import overlapkit

STEPS = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(24)
        self.fc = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    """An input layer, three blocks and a head; the blocks (and, with
    ``head_inside=True``, the head with the last block, so that the first gradients of
    a backward come from a nested one) are recomputed in backward."""

    def __init__(self, head_inside: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 24)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(24, 4)
        self.head_inside = head_inside

    def _last(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks[-1](x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks[:-1]:
            x = checkpoint(block, x, use_reentrant=True)
        if self.head_inside:
            return checkpoint(self._last, x, use_reentrant=True)  # type: ignore[no-any-return]
        return self.head(checkpoint(self.blocks[-1], x, use_reentrant=True))


def _net(head_inside: bool) -> Net:
    torch.manual_seed(0)
    return Net(head_inside)


def _fsdp2(head_inside: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _net(head_inside)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model, mesh=mesh)
    return model


#: name -> model builder (takes head_inside)
MODELS: dict[str, Callable[[bool], nn.Module]] = {
    "ddp": lambda head: DDP(_net(head), bucket_cap_mb=0.001),
    "ddp static_graph": lambda head: DDP(_net(head), bucket_cap_mb=0.001, static_graph=True),
    "module": _net,
    "fsdp2": _fsdp2,
}
#: name -> (technique, options)
TECHNIQUES: dict[str, tuple[str, dict[str, Any]]] = {
    "overlap_ddp": ("overlap_ddp", {}),
    "overlap_ddp global clipping": ("overlap_ddp", {"clip_grad_norm": 0.05}),
    "optimizer_in_backward": ("optimizer_in_backward", {}),
    "optimizer_in_backward global clipping": ("optimizer_in_backward", {"clip_grad_norm": 0.05}),
}


def cases() -> list[tuple[str, str, bool]]:
    out = []
    for model in MODELS:
        for technique, (function, _) in TECHNIQUES.items():
            if function == "overlap_ddp" and not model.startswith("ddp"):
                continue
            out.extend((model, technique, head_inside) for head_inside in (False, True))
    return out


def _train(model: nn.Module, opt: Any, rank: int, clip: float | None,
           plain: bool) -> list[torch.Tensor]:
    for x in rank_batches(rank, STEPS):
        model(x).square().mean().backward()
        if plain and clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return values(model)


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    start = values(_net(False))
    for model_name, technique, head_inside in cases():
        function, options = TECHNIQUES[technique]
        build = MODELS[model_name]
        plain_model = build(head_inside)
        expected = _train(plain_model, torch.optim.AdamW(plain_model.parameters(), lr=0.01),
                          rank, options.get("clip_grad_norm"), plain=True)
        model = build(head_inside)
        opt = getattr(overlapkit, function)(model, torch.optim.AdamW, lr=0.01, **options)
        got = _train(model, opt, rank, None, plain=False)
        where = "head inside" if head_inside else "head outside"
        out[f"{model_name} | {technique} | {where}"] = {
            "values": compare(expected, got), "trained": not compare(start, got)}
    return out
