"""The rank side of tests/test_step_hooks.py: a loop whose optimizer has a step
pre-hook (registered on it, or for every optimizer through torch), which clips, adds
noise or reads the optimizer's state when ``step()`` is called; and one with a step
post-hook (an EMA), on the optimizer or for every optimizer (torch's
``register_optimizer_step_post_hook``, over two param groups: before 0.4 it ran once per
group or bucket stepped during backward, on half-stepped parameters). Each run against
the plain loop with the same hooks, bitwise, with what the hooks logged and how often
they ran; with sharded state a global post-hook is refused."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from helpers import error_of, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import overlapkit

STEPS = 4


def _model(ddp: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])
    return DDP(model, bucket_cap_mb=0.02) if ddp else model


class Loop:
    """The hooks of one case; ``calls`` counts their runs, ``logged`` what they read."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.calls = 0
        self.logged: list[float] = []
        self.ema = [p.detach().clone() for p in model.parameters()]

    def clip(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.calls += 1
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.05)

    def noise(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.calls += 1
        for param in self.model.parameters():
            param.grad.add_(1e-3)

    def read_state(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.calls += 1
        self.logged.append(sum(float(s["exp_avg"].norm()) for s in optimizer.state.values()
                               if "exp_avg" in s))

    def ema_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.calls += 1
        for average, param in zip(self.ema, self.model.parameters(), strict=True):
            average.mul_(0.9).add_(param.detach(), alpha=0.1)


#: case -> (registers the hooks on ``opt`` for ``loop``, returning their handles;
#: the step before which they are removed, or None)
CASES: dict[str, tuple[Callable[[Loop, Any], list[Any]], int | None]] = {
    "clip": (lambda loop, opt: [opt.register_step_pre_hook(loop.clip)], None),
    "noise": (lambda loop, opt: [opt.register_step_pre_hook(loop.noise)], None),
    "state read": (lambda loop, opt: [opt.register_step_pre_hook(loop.read_state)], None),
    "global clip": (lambda loop, opt: [register_optimizer_step_pre_hook(loop.clip)], None),
    "clip removed after 2 steps": (
        lambda loop, opt: [opt.register_step_pre_hook(loop.clip)], 2),
    "post-hook EMA": (lambda loop, opt: [opt.register_step_post_hook(loop.ema_update)], None),
    "global post-hook EMA": (
        lambda loop, opt: [register_optimizer_step_post_hook(loop.ema_update)], None),
}
#: the cases whose optimizer has two param groups (a plain module's parameters are
#: stepped during backward in one call per group)
TWO_GROUPS = {"global post-hook EMA"}


def _build(technique: str, model: nn.Module, groups: bool) -> Any:
    kwargs: dict[str, Any] = {"lr": 1e-2}
    params: Any = list(model.parameters())
    if groups:
        params = [{"params": params[:6]}, {"params": params[6:], "lr": 5e-3}]
    if technique == "plain":
        return torch.optim.AdamW(params, **kwargs)
    kwargs["params"] = params
    if technique == "overlap_ddp":
        return overlapkit.overlap_ddp(model, torch.optim.AdamW, **kwargs)
    if technique == "overlap_ddp sharded":
        return overlapkit.overlap_ddp(model, torch.optim.AdamW, shard_optimizer_state=True,
                                      **kwargs)
    return overlapkit.optimizer_in_backward(model, torch.optim.AdamW, **kwargs)


def train(rank: int, technique: str, case: str, ddp: bool) -> dict[str, Any]:
    model = _model(ddp)
    opt = _build(technique, model, case in TWO_GROUPS)
    loop = Loop(model)
    before = values(model)
    register, remove_at = CASES[case]
    handles = register(loop, opt)
    found: dict[str, Any] = {"error": None}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, batch in enumerate(rank_batches(rank, STEPS, (8, 64))):
                if i == remove_at:
                    for handle in handles:
                        handle.remove()
                found["error"] = (error_of(model(batch).square().mean().backward)
                                  or error_of(opt.step))
                if found["error"] is not None:
                    break
                opt.zero_grad()
    finally:
        for handle in handles:
            handle.remove()
    found["steps"] = i
    found["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, values(model),
                                                                 strict=True))
    found["values"] = values(model) + loop.ema
    found["calls"], found["logged"] = loop.calls, loop.logged
    found["warnings"] = [str(w.message) for w in caught
                         if "plain order" in str(w.message)]
    return found


#: setting -> (a DDP model, the techniques, the cases)
SETTINGS: dict[str, tuple[bool, tuple[str, ...], tuple[str, ...]]] = {
    "plain module": (False, ("optimizer_in_backward",), tuple(CASES)),
    "DDP": (True, ("overlap_ddp", "optimizer_in_backward"), tuple(CASES)),
    # the sharded optimizer refuses hooks registered on it (they would run per share
    # stepped); a global pre-hook is the loop's, a global post-hook is refused as the
    # first backward starts (it would run before the other ranks' updates arrive)
    "DDP sharded": (True, ("overlap_ddp sharded",), ("global clip", "global post-hook EMA")),
}


def run(rank: int, world_size: int, settings: tuple[str, ...]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for setting in settings:
        ddp, techniques, cases = SETTINGS[setting]
        for case in cases:
            plain = train(rank, "plain", case, ddp)
            for technique in techniques:
                mine = train(rank, technique, case, ddp)
                out[setting, technique, case] = {
                    "error": mine["error"], "plain error": plain["error"],
                    "bitwise": all(torch.equal(a, b) for a, b in
                                   zip(plain["values"], mine["values"], strict=True)),
                    "calls": (mine["calls"], plain["calls"]),
                    "same log": mine["logged"] == plain["logged"],
                    "stepped before the error": mine["steps"],
                    "unchanged": mine["unchanged"],
                    "warnings": mine["warnings"]}
    return out
