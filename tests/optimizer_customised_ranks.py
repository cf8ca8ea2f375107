"""The rank side of tests/test_optimizer_customised.py: an optimizer whose own
``zero_grad`` keeps zero gradients (a subclass of ``AdamW`` calling
``super().zero_grad(set_to_none=False)``, or a ``zero_grad`` set on the instance), on a
model whose last layer is used every other step, against the plain loop; and optimizers
whose ``step()`` requires a closure, at set-up; a parameter listed in two groups."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 4


class Zeroing(torch.optim.AdamW):
    """Keeps zero gradients whatever ``zero_grad()`` asks (as ``set_to_none=False``)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=False)


def patched_zero_grad(params: Any, **options: Any) -> torch.optim.AdamW:
    """An ``AdamW`` whose ``zero_grad`` the loop set on the instance to keep zeros."""
    optimizer = torch.optim.AdamW(params, **options)
    zero_grad = optimizer.zero_grad

    def zeroing(set_to_none: bool = True) -> None:
        zero_grad(set_to_none=False)

    optimizer.zero_grad = zeroing  # type: ignore[method-assign]
    return optimizer


BUILDS = {"subclass": Zeroing, "instance patch": patched_zero_grad}


class EveryOther(nn.Module):
    """Its last layer ``c`` is used on odd forwards only: the plain loop steps it on its
    zero gradient in between (Adam's moments)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 4), nn.Linear(16, 4)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        h = torch.tanh(self.a(x))
        return self.b(h) + self.c(h) if self.forwards % 2 else self.b(h)


def _model(ddp: bool) -> nn.Module:
    model = EveryOther()
    return DDP(model, bucket_cap_mb=0.0005, find_unused_parameters=True) if ddp else model


def _train(
    rank: int, technique: str | None, ddp: bool, build: str, learn: bool = False
) -> dict[str, Any]:
    """``STEPS`` steps (backward, ``step()``, ``zero_grad()``): the parameters, the
    overlap warnings, the error, and whether the refused call changed anything."""
    model = _model(ddp)
    module = model.module if ddp else model
    optimizer = BUILDS[build](module.parameters(), lr=1e-2)
    opt: Any = optimizer
    if technique is not None:
        opt = getattr(overlapkit, technique)(model, optimizer)
        if learn:
            opt.learn_first_step(module)
    found: dict[str, Any] = {"unchanged": None}

    def loop() -> None:
        for x in rank_batches(rank, STEPS, (8, 16)):
            model(x).pow(2).mean().backward()
            opt.step()
            before = (
                values(module),
                [p.grad is None for p in module.parameters()],
                len(optimizer.state),
            )
            try:
                opt.zero_grad()
            except Exception:
                found["unchanged"] = (
                    bool(compare(before[0], values(module)))
                    and before[1] == [p.grad is None for p in module.parameters()]
                    and before[2] == len(optimizer.state)
                )
                raise

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found["error"] = error_of(loop)
    if technique is not None:
        opt.release()
    found["values"] = values(module)
    found["warnings"] = [str(w.message) for w in caught if "without overlap: " in str(w.message)]
    return found


class RequiresClosure(torch.optim.Optimizer):
    """SGD whose ``step()`` requires the closure (re-evaluates the loss first)."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any) -> Any:  # type: ignore[override]
        with torch.enable_grad():
            loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


class CallsClosure(RequiresClosure):
    """Its ``step(closure=None)`` calls the closure all the same."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


class AssertsClosure(RequiresClosure):
    """Its ``step(closure=None)`` asserts a closure was given (as SAM's does)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        assert closure is not None, "this optimizer requires a closure"
        return super().step(closure)


CLOSURES = {
    "closure": RequiresClosure,
    "closure called": CallsClosure,
    "closure asserted": AssertsClosure,
}


def _closure_required(rank: int, technique: str, ddp: bool, kind: str) -> dict[str, Any]:
    """Set-up and one backward with an optimizer whose ``step()`` requires a closure
    (``kind``: in its signature, or by calling or asserting it)."""
    model = _model(ddp)
    module = model.module if ddp else model
    before = values(module)

    def run() -> None:
        opt = getattr(overlapkit, technique)(model, CLOSURES[kind](module.parameters()))
        model(rank_batches(rank, 1, (8, 16))[0]).pow(2).mean().backward()
        opt.release()

    return {"error": error_of(run), "unchanged": bool(compare(before, values(module)))}


def _listed_twice(rank: int, technique: str, ddp: bool) -> dict[str, Any]:
    """A step, then a parameter of group 0 appended by hand to group 1 of the adopted
    AdamW: the next backward is refused, nothing stepped in it."""
    model = _model(ddp)
    module = model.module if ddp else model
    params = list(module.parameters())
    optimizer = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    opt = getattr(overlapkit, technique)(model, optimizer)
    batches = rank_batches(rank, 2, (8, 16))
    model(batches[0]).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    optimizer.param_groups[1]["params"].append(params[1])
    before = values(module)
    error = error_of(lambda: model(batches[1]).pow(2).mean().backward())
    unchanged = bool(compare(before, values(module)))
    opt.release()
    return {"error": error, "unchanged": unchanged}


SETTINGS = {
    "plain module": (False, ("optimizer_in_backward",)),
    "DDP": (True, ("overlap_ddp", "optimizer_in_backward")),
}


def run(rank: int, world_size: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for setting, (ddp, techniques) in SETTINGS.items():
        if not ddp and rank:
            continue
        for build in BUILDS:
            plain = _train(rank, None, ddp, build)
            assert plain["error"] is None, plain["error"]
            for technique in techniques:
                for learn in (False, True):
                    found = _train(rank, technique, ddp, build, learn)
                    found["bitwise"] = compare(plain["values"], found.pop("values"))
                    out[setting, technique, build, learn] = found
        for technique in techniques:
            for kind in CLOSURES:
                out[setting, technique, kind] = _closure_required(rank, technique, ddp, kind)
            out[setting, technique, "listed twice"] = _listed_twice(rank, technique, ddp)
    return out
