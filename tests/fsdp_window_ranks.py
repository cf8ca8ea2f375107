"""The rank side of tests/test_fsdp_window.py: ``optimizer_in_backward`` on an FSDP2
model (2 gloo ranks, ``DTensor`` parameters and gradients), in a hand-written loop that
works between backward and ``step()``, told to learn its first step or not; and rebuilt
on the same model. Each run against the plain loop with the same optimizer, bitwise."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from helpers import compare, error_of, rank_batches, shard_linears
from torch import nn

import overlapkit


def _model() -> nn.Module:
    torch.manual_seed(0)
    return shard_linears(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[operator]


def _noise(model: nn.Module) -> None:
    for param in model.parameters():
        param.grad.add_(torch.full_like(param.grad, 1e-3))


def _read_norms(model: nn.Module) -> None:
    [param.grad.norm() for param in model.parameters()]


def _warm_up(model: nn.Module, opt: Any, i: int) -> None:
    for group in opt.param_groups:
        group["lr"] = 1e-2 * (i + 1) / 3


#: name -> what the loop does between backward and step()
WINDOWS: dict[str, Callable[[nn.Module, Any, int], None]] = {
    "noise": lambda model, opt, i: _noise(model),
    "norms read": lambda model, opt, i: _read_norms(model),
    "warm-up": _warm_up,
    "nothing": lambda model, opt, i: None,
}


def _loop(rank: int, overlapped: bool, window: Callable[[nn.Module, Any, int], None],
          learn: bool) -> dict[str, Any]:
    model = _model()
    kwargs = {"lr": 1e-2, "momentum": 0.9}
    if overlapped:
        opt: Any = overlapkit.optimizer_in_backward(model, torch.optim.SGD, **kwargs)
        if learn:
            opt.learn_first_step(model)
    else:
        opt = torch.optim.SGD(model.parameters(), **kwargs)
    found: dict[str, Any] = {"error": None, "at": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, batch in enumerate(rank_batches(rank, 3)):
            model(batch).square().mean().backward()
            window(model, opt, i)
            found["error"] = error_of(opt.step)
            if found["error"] is not None:
                found["at"] = i
                break
            opt.zero_grad()
    found["values"] = _full(model)
    found["warnings"] = [str(w.message) for w in caught if "plain order" in str(w.message)]
    return found


def _ema_loop(rank: int, overlapped: bool, learn: bool) -> dict[str, Any]:
    """AdamW, 4 steps, an EMA of the ``DTensor`` parameters updated between backward
    and ``step()``: the EMA, and the warnings."""
    model = _model()
    opt: Any = (overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2)
                if overlapped else torch.optim.AdamW(model.parameters(), lr=1e-2))
    if overlapped and learn:
        opt.learn_first_step(model)
    ema = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in rank_batches(rank, 4):
            model(batch).square().mean().backward()
            with torch.no_grad():
                for average, param in zip(ema, model.parameters(), strict=True):
                    average.lerp_(param, 0.1)
            opt.step()
            opt.zero_grad()
    return {"ema": [e.full_tensor() for e in ema],  # type: ignore[attr-defined]
            "values": _full(model),
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def _rebuilt(rank: int, how: str) -> Any:
    """Two AdamW steps, then two SGD steps by a new optimizer on the same model
    (``how``: the old one released, or a plain SGD after it was released)."""
    batches = rank_batches(rank, 4)
    plain = _model()
    first: Any = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    second: Any = torch.optim.SGD(plain.parameters(), lr=1e-2)
    model = _model()
    opt: Any = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2)
    for i, batch in enumerate(batches):
        for net, step in ((plain, first if i < 2 else second), (model, opt)):
            net(batch).square().mean().backward()
            step.step()
            step.zero_grad()
        if i == 1:
            opt.release()
            opt = (overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=1e-2)
                   if how == "rebuilt" else torch.optim.SGD(model.parameters(), lr=1e-2))
    return compare(_full(plain), _full(model))


def _plain_while_held(rank: int) -> Any:
    model = _model()
    overlapped = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2)
    plain = torch.optim.SGD(model.parameters(), lr=1e-2)
    model(rank_batches(rank, 1)[0]).square().mean().backward()
    before = _full(model)
    error = error_of(plain.step)
    del overlapped
    return {"error": error, "unchanged by it": compare(before, _full(model))}


def run(rank: int, world_size: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, window in WINDOWS.items():
        plain = _loop(rank, False, window, learn=False)
        # without learning, the gradients are freed once stepped: the loop's own
        # AttributeError (documented), so the gradient-using loops run learnt only
        for learn in (True, False) if name in ("warm-up", "nothing") else (True,):
            ours = _loop(rank, True, window, learn)
            ours["bitwise plain"] = (ours["error"] is None
                                     and compare(plain["values"], ours["values"]))
            del ours["values"]
            found[f"{name} learn={learn}"] = ours
    plain = _ema_loop(rank, False, False)
    for learn in (True, False):
        ours = _ema_loop(rank, True, learn)
        found[f"ema learn={learn}"] = {
            "ema bitwise": compare(plain["ema"], ours["ema"]),
            "bitwise plain": compare(plain["values"], ours["values"]),
            "warnings": ours["warnings"]}
    found["rebuilt"] = _rebuilt(rank, "rebuilt")
    found["plain after release"] = _rebuilt(rank, "plain")
    found["plain while held"] = _plain_while_held(rank)
    return found
