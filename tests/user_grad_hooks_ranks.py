"""The rank side of tests/test_user_grad_hooks.py: a loop that registers a
post-accumulate-grad hook of its own on the parameters (gradient noise, a gradient-norm
logger), after overlapkit set them up, before or in the middle of training; each run
against the plain loop with the same hooks, bitwise, with the same values logged.

The model is large enough that, on CPU, ``optimizer_in_backward`` steps a batch of
parameters before backward ends (4 MiB of gradient per batch): the hook of the
parameter that closes a batch runs inside that backward, as on a GPU every one does."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from helpers import error_of, rank_batches, shard_linears, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 3
WIDTH = 512


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                           for _ in range(layers)], nn.Linear(WIDTH, 2))


class Hooks:
    """The loop's own hooks: halve each gradient, then log its norm (a float per
    parameter per backward, in the order autograd completes them)."""

    def __init__(self) -> None:
        self.logged: list[float] = []
        self.handles: list[Any] = []

    def halve(self, param: torch.Tensor) -> None:
        param.grad.mul_(0.5)

    def log(self, param: torch.Tensor) -> None:
        self.logged.append(float(param.grad.norm()))

    def register(self, model: nn.Module) -> None:
        for param in model.parameters():
            self.handles.append(param.register_post_accumulate_grad_hook(self.halve))
            self.handles.append(param.register_post_accumulate_grad_hook(self.log))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


#: when the loop registers its hooks: name -> (before set-up, at the start of step i,
#: removed at the start of step i or never)
WHEN: dict[str, tuple[bool, int | None, int | None]] = {
    "before set-up": (True, None, None),
    "after set-up": (False, 0, None),
    "mid-training": (False, 1, None),
    "removed mid-training": (False, 0, 2),
}


def _build(technique: str, model: nn.Module) -> Any:
    kwargs = {"lr": 1e-3}
    if technique == "plain":
        return torch.optim.AdamW(model.parameters(), **kwargs)
    if technique == "overlap_ddp":
        return overlapkit.overlap_ddp(model, torch.optim.AdamW, **kwargs)
    return overlapkit.optimizer_in_backward(model, torch.optim.AdamW, **kwargs)


def train(rank: int, technique: str, when: str, wrap: Callable[[nn.Module], nn.Module],
          layers: int) -> dict[str, Any]:
    """Three steps with the loop's hooks registered as ``when`` says."""
    model = wrap(_model(layers))
    hooks = Hooks()
    early, register_at, remove_at = WHEN[when]
    if early:
        hooks.register(model)
    opt = _build(technique, model)
    found: dict[str, Any] = {"error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, batch in enumerate(rank_batches(rank, STEPS, (4, WIDTH))):
            if i == register_at:
                hooks.register(model)
            if i == remove_at:
                hooks.remove()
            found["error"] = error_of(lambda b=batch: model(b).square().mean().backward())
            if found["error"] is not None:
                break
            opt.step()
            opt.zero_grad()
    found["values"] = values(model)
    found["logged"] = hooks.logged
    found["warnings"] = [str(w.message) for w in caught
                         if "overlapkit" in type(w.message).__module__]
    return found


def _plain_module(model: nn.Module) -> nn.Module:
    return model


def _ddp(model: nn.Module) -> nn.Module:
    return DDP(model, bucket_cap_mb=1)


#: setting -> (the wrapper, layers, the techniques overlapkit offers for it)
SETTINGS: dict[str, tuple[Callable[[nn.Module], nn.Module], int, tuple[str, ...]]] = {
    "plain module": (_plain_module, 12, ("optimizer_in_backward",)),
    "DDP": (_ddp, 6, ("overlap_ddp", "optimizer_in_backward")),
    "FSDP2": (shard_linears, 12, ("optimizer_in_backward",)),
}


def run(rank: int, world_size: int, settings: tuple[str, ...]) -> dict[str, Any]:
    """Every (setting, technique, when) of ``settings`` against the plain loop."""
    out: dict[str, Any] = {}
    for setting in settings:
        wrap, layers, techniques = SETTINGS[setting]
        for when in WHEN:
            plain = train(rank, "plain", when, wrap, layers)
            for technique in techniques:
                mine = train(rank, technique, when, wrap, layers)
                out[setting, technique, when] = {
                    "error": mine["error"], "plain error": plain["error"],
                    "bitwise": all(torch.equal(a, b) for a, b in
                                   zip(plain["values"], mine["values"], strict=True)),
                    "same log": plain["logged"] == mine["logged"],
                    "logged": len(mine["logged"]), "warnings": mine["warnings"]}
    return out
