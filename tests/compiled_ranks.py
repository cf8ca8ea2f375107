"""The rank side of tests/test_compiled.py: torch.compile'd modules (``aot_eager``: the
real dynamo + AOTAutograd path, no C++ toolchain needed) under each technique."""

from __future__ import annotations

from typing import Any

import torch
from helpers import compare, error_of, max_diff, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 4


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _train(ddp: nn.Module, opt: Any, rank: int, *,
           compiled_step: bool = False) -> list[torch.Tensor]:
    """``STEPS`` steps; ``compiled_step``: ``opt.step()`` and ``zero_grad()`` called
    from a ``torch.compile``'d function, as torch's "compiling the optimizer" recipe
    does."""

    def step() -> None:
        opt.step()
        opt.zero_grad()

    stepping = torch.compile(step, backend="aot_eager") if compiled_step else step
    for x in rank_batches(rank, STEPS):
        ddp(x).square().mean().backward()
        stepping()
    return values(ddp)


def _compiled_step(rank: int, technique: str, options: dict[str, Any],
                   plain: dict[bool, list[torch.Tensor]]) -> dict[str, Any]:
    """The technique's ``step()`` called from a compiled function, against the plain
    loop's eager step (``plain[False]``: overlapkit steps eagerly during backward) and
    its compiled one (``plain[True]``: the compiled AdamW rounds otherwise)."""
    ddp = DDP(model())
    build = getattr(overlapkit, "overlap_ddp" if technique == "sharded" else technique)
    opt = build(ddp, torch.optim.AdamW, lr=0.01, **options)
    found: list[Any] = []
    error = error_of(lambda: found.append(_train(ddp, opt, rank, compiled_step=True)))
    opt.release()
    return {"error": error, "bitwise": compare(plain[False], found[0]) if found else None,
            "off compiled": max_diff(plain[True], found[0]) if found else None}


def _local_sgd(rank: int, overlapped: bool, compiled_step: bool) -> list[torch.Tensor]:
    """Post-local SGD (period 2 after 1 warm-up step): a plain local AdamW, or an
    ``optimizer_in_backward`` one under a ``PostLocalSGDOptimizer``."""
    ddp = DDP(model())
    if overlapped:
        local = overlapkit.optimizer_in_backward(ddp, torch.optim.AdamW, lr=0.01)
        opt: Any = overlapkit.PostLocalSGDOptimizer(local, overlapkit.create_averager(
            "periodic", period=2, warmup_steps=1))
    else:
        opt = overlapkit.post_local_sgd(ddp, torch.optim.AdamW(ddp.parameters(), lr=0.01),
                                        period=2, warmup_steps=1)
    found = _train(ddp, opt, rank, compiled_step=compiled_step)
    if overlapped:
        local.release()
    return found


def run(rank: int, world_size: int) -> dict[str, Any]:
    torch._dynamo.reset()
    plain = DDP(torch.compile(model(), backend="aot_eager"))
    expected = _train(plain, torch.optim.AdamW(plain.parameters(), lr=0.01), rank)
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        ddp = DDP(torch.compile(model(), backend="aot_eager"))
        opt = getattr(overlapkit, technique)(ddp, torch.optim.AdamW, lr=0.01)
        out[technique] = compare(expected, _train(ddp, opt, rank))
    plain = {compiled: _train(ddp, torch.optim.AdamW(ddp.parameters(), lr=0.01), rank,
                              compiled_step=compiled)
             for compiled in (False, True) for ddp in [DDP(model())]}
    for technique, options in (("overlap_ddp", {}), ("optimizer_in_backward", {}),
                               ("sharded", {"shard_optimizer_state": True})):
        out[technique, "compiled step"] = _compiled_step(rank, technique, options, plain)
    for overlapped in (False, True):
        eager = _local_sgd(rank, overlapped, False)
        found: list[Any] = []
        error = error_of(lambda: found.append(_local_sgd(rank, overlapped, True)))  # noqa: B023
        out["post-local SGD", overlapped] = {
            "error": error, "bitwise": compare(eager, found[0]) if found else None,
            "off eager": max_diff(eager, found[0]) if found else None}
    return out
