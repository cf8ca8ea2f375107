"""The rank side of tests/test_optimizer_overrides.py: loops whose optimizer the user
customised where overlapkit calls it. A subclass of ``AdamW`` overriding ``step()`` (it
counts its calls and adds seeded noise after the update), and the adopted ``AdamW``
stepped, or given parameters (``add_param_group``), through a reference kept to it
instead of the overlapped optimizer. Each on a
plain module (``optimizer_in_backward``) and on DDP (both techniques), against the
plain loop."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 4


class Noisy(torch.optim.AdamW):
    """Counts its ``step()`` calls and adds noise after the update, seeded by the count
    (the same on every rank)."""

    def __init__(self, params: Any, **options: Any) -> None:
        super().__init__(params, **options)
        self.calls = 0

    def step(self, closure: Any = None) -> Any:
        self.calls += 1
        loss = super().step(closure)
        generator = torch.Generator().manual_seed(self.calls)
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(torch.randn(p.shape, generator=generator), alpha=1e-3)
        return loss


def patched_adamw(params: Any, **options: Any) -> torch.optim.AdamW:
    """An ``AdamW`` whose ``step`` the loop patched on the instance, doing what
    :class:`Noisy` does, over an LR scheduler's own patch (built first, as a recipe
    builds it), which only notes the call."""
    optimizer = torch.optim.AdamW(params, **options)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    saved = optimizer.step
    optimizer.calls = 0  # type: ignore[attr-defined]

    def noisy_step(closure: Any = None) -> Any:
        optimizer.calls += 1  # type: ignore[attr-defined]
        loss = saved(closure)
        generator = torch.Generator().manual_seed(optimizer.calls)  # type: ignore[attr-defined]
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.add_(torch.randn(p.shape, generator=generator), alpha=1e-3)
        return loss

    optimizer.step = noisy_step  # type: ignore[method-assign]
    return optimizer


BUILDS = {"subclass": Noisy, "instance patch": patched_adamw}


def _model(ddp: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    return DDP(model, bucket_cap_mb=0.005) if ddp else model


def _train(rank: int, technique: str | None, ddp: bool, *, learn: bool = False,
           steps: bool = True, build: str = "subclass") -> dict[str, Any]:
    """``STEPS`` steps with a Noisy optimizer: the parameters, its calls, the overlap
    warnings, the error."""
    model = _model(ddp)
    module = model.module if ddp else model
    optimizer: Any = BUILDS[build](model.parameters(), lr=1e-2)
    opt: Any = optimizer
    if technique is not None:
        opt = getattr(overlapkit, technique)(model, optimizer)
        if learn:
            opt.learn_first_step(module)

    def loop() -> None:
        for x in rank_batches(rank, STEPS, (8, 32)):
            model(x).pow(2).mean().backward()
            if steps:
                opt.step()
                opt.zero_grad()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = error_of(loop)
    if technique is not None:
        opt.release()
    return {"values": values(module), "calls": optimizer.calls, "error": error,
            "warnings": [str(w.message) for w in caught if "without overlap: " in str(w.message)]}


def _adopted_step(rank: int, technique: str, ddp: bool) -> dict[str, Any]:
    """One backward, then ``step()`` on the adopted AdamW: refused, nothing stepped by it;
    after ``release()`` that AdamW steps as a plain one."""
    model = _model(ddp)
    module = model.module if ddp else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = getattr(overlapkit, technique)(model, optimizer)
    model(rank_batches(rank, 1, (8, 32))[0]).pow(2).mean().backward()
    before = values(module)
    error = error_of(optimizer.step)
    unchanged = compare(before, values(module))
    opt.release()
    return {"error": error, "unchanged": unchanged,
            "after release": error_of(optimizer.step)}


def _added_behind(rank: int, technique: str, ddp: bool) -> dict[str, Any]:
    """A step, then the adopted AdamW's own ``add_param_group`` of the parameters it did
    not hold: the next backward is refused, nothing stepped in it."""
    model = _model(ddp)
    module = model.module if ddp else model
    layers = list(module)
    optimizer = torch.optim.AdamW(layers[0].parameters(), lr=1e-2)
    opt = getattr(overlapkit, technique)(model, optimizer)
    batches = rank_batches(rank, 2, (8, 32))
    model(batches[0]).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    optimizer.add_param_group({"params": [p for layer in layers[1:]
                                          for p in layer.parameters()]})
    before = values(module)
    error = error_of(lambda: model(batches[1]).pow(2).mean().backward())
    unchanged = compare(before, values(module))
    opt.release()
    return {"error": error, "unchanged": unchanged}


def _sharded(rank: int, plain: list[torch.Tensor], build: str = "subclass") -> dict[str, Any]:
    """``overlap_ddp(..., shard_optimizer_state=True)`` of a Noisy optimizer: refused at
    set-up (each rank would run the override on its share); else trained, compared."""
    model = _model(True)
    optimizer = BUILDS[build](model.parameters(), lr=1e-2)
    made: list[Any] = []
    error = error_of(lambda: made.append(overlapkit.overlap_ddp(
        model, optimizer, shard_optimizer_state=True)))
    if error is not None:
        return {"error": error, "bitwise": None}
    opt = made[0]
    opt.learn_first_step(model.module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in rank_batches(rank, STEPS, (8, 32)):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    opt.release()
    return {"error": None, "bitwise": compare(plain, values(model.module))}


def _sharded_patched_later(rank: int) -> dict[str, Any]:
    """``overlap_ddp(..., shard_optimizer_state=True)`` of an AdamW whose ``step`` the
    loop patches on the instance after a step: the next backward is refused, nothing
    stepped in it."""
    model = _model(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = overlapkit.overlap_ddp(model, optimizer, shard_optimizer_state=True)
    batches = rank_batches(rank, 2, (8, 32))
    model(batches[0]).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    saved = optimizer.step
    optimizer.step = lambda closure=None: saved(closure)  # type: ignore[method-assign]
    before = values(model.module)
    error = error_of(lambda: model(batches[1]).pow(2).mean().backward())
    unchanged = compare(before, values(model.module))
    opt.release()
    return {"error": error, "unchanged": unchanged}


SETTINGS = {"plain module": (False, ("optimizer_in_backward",)),
            "DDP": (True, ("overlap_ddp", "optimizer_in_backward"))}


def run(rank: int, world_size: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for setting, (ddp, techniques) in SETTINGS.items():
        if ddp or rank == 0:
            plain = _train(rank, None, ddp)
            for technique in techniques:
                for build in BUILDS:
                    learnt = _train(rank, technique, ddp, learn=True, build=build)
                    out[setting, technique, "learnt", build] = {
                        "bitwise": compare(plain["values"], learnt["values"]),
                        "calls": (learnt["calls"], plain["calls"]),
                        "error": learnt["error"], "warnings": learnt["warnings"]}
                    out[setting, technique, "not learnt", build] = _train(
                        rank, technique, ddp, build=build)
                out[setting, technique, "adopted step()"] = _adopted_step(rank, technique, ddp)
                out[setting, technique, "added behind"] = _added_behind(rank, technique, ddp)
        if ddp:
            for build in BUILDS:
                out["sharded", build] = _sharded(rank, plain["values"], build)
            out["sharded, patched later"] = _sharded_patched_later(rank)
    if rank == 0:
        out["backward only"] = _train(rank, "optimizer_in_backward", False, steps=False)
    return out
