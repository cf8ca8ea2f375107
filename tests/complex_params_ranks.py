"""The rank side of tests/test_complex_params.py: a DDP model with complex parameters
(``nn.Linear(dtype=torch.complex64)`` and a complex ``nn.Parameter``) beside real ones,
trained by the plain loop and by each technique on the same batches (gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch
from helpers import compare, error_of, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "SGD": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.01}),
}


class ComplexNet(nn.Module):
    """A real layer feeding a complex one and a complex matrix."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.real = nn.Linear(16, 16)
        self.complex = nn.Linear(16, 16, dtype=torch.complex64)
        self.weight = nn.Parameter(torch.randn(16, 4, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.complex(self.real(x).to(torch.complex64)) @ self.weight


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for group in opt.param_groups for p in group["params"]
            for _, value in sorted(opt.state[p].items()) if torch.is_tensor(value)]


def train(rank: int, technique: str, name: str, bucket_view: bool) -> dict[str, Any]:
    """4 steps; ``technique``: ``plain``, ``overlap_ddp``, ``optimizer_in_backward`` or
    ``sharded`` (``overlap_ddp(shard_optimizer_state=True)``)."""
    model = ComplexNet()
    ddp = DDP(model, gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.001)
    cls, settings = OPTIMIZERS[name]
    if technique == "sharded":  # ZeRO-1: the same bucket views
        opt: Any = overlapkit.overlap_ddp(ddp, cls, shard_optimizer_state=True, **settings)
    elif technique == "plain":
        opt = cls(model.parameters(), **settings)
    else:
        opt = getattr(overlapkit, technique)(ddp, cls, **settings)
    generator = torch.Generator().manual_seed(rank)

    def steps() -> None:
        for _ in range(4):
            ddp(torch.randn(8, 16, generator=generator)).abs().square().mean().backward()
            opt.step()
            opt.zero_grad()

    return {"error": error_of(steps), "values": values(model), "state": _state(opt)}


def run(rank: int, world_size: int) -> dict[tuple[str, str, bool], dict[str, Any]]:
    """Each technique against the plain loop: parameters and state compared here."""
    out = {}
    for name in OPTIMIZERS:
        for bucket_view in (False, True):
            plain = train(rank, "plain", name, bucket_view)
            for technique in ("overlap_ddp", "optimizer_in_backward"):
                got = train(rank, technique, name, bucket_view)
                out[technique, name, bucket_view] = {
                    "error": got["error"],
                    "values": compare(plain["values"], got["values"]),
                    "state": compare(plain["state"], got["state"])}
            got = train(rank, "sharded", name, bucket_view)
            out["sharded", name, bucket_view] = {  # its state is each rank's share
                "error": got["error"], "values": compare(plain["values"], got["values"]),
                "state": compare([], [])}
    return out
