"""The rank side of tests/test_part_steps.py: optimizers whose ``step()`` does not step
each parameter on its own (a norm over every gradient, a counter on the optimizer, in
its param groups or under a key of ``self.state``, an LR from the parameter's index, an
``_init_group`` override counting its calls) handed to ``overlap_ddp`` (with and without
sharded state) and ``optimizer_in_backward``; and one from scratch that steps each
parameter on its own, against the plain loop."""

from __future__ import annotations

from typing import Any

import torch
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 3


class _Update(torch.optim.Optimizer):
    """Momentum SGD from scratch, each class defining the only ``step()`` of its line
    (one overriding another's is taken at ``step()``: tests/test_optimizer_overrides.py);
    ``_scale`` is what the classes change."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    def _scale(self, group: dict[str, Any], index: int) -> float:
        return 1.0

    def _update(self) -> None:
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                state["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                p.add_(state["m"], alpha=-group["lr"] * self._scale(group, index))


class Momentum(_Update):
    """Steps each parameter on its own: stepped part by part as before."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self._update()


class Counted(_Update):
    """Bias correction from a step counter kept as an attribute."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, lr)
        self.t = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.t += 1
        self._update()

    def _scale(self, group: dict[str, Any], index: int) -> float:
        return 1 / (1 - 0.9 ** self.t)


class GroupCounted(_Update):
    """timm's ``Lamb``'s way: the counter in each param group."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
        self._update()

    def _scale(self, group: dict[str, Any], index: int) -> float:
        return 1 / (1 - 0.9 ** group["step"])


class GlobalNorm(torch.optim.Optimizer):
    """Each update divided by the norm of every gradient (LAMB's global clipping)."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (norm + 1e-6), alpha=-group["lr"])


class LayerDecay(_Update):
    """A layer-wise LR decay from the parameter's index in the groups."""

    def _scale(self, group: dict[str, Any], index: int) -> float:
        return 0.8 ** index

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self._update()


class CountingInit(torch.optim.Adam):
    """An ``Adam`` whose ``_init_group`` override warms the LR up by its calls."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, lr=lr)
        self.calls = 0

    def _init_group(self, group: dict[str, Any], *args: Any) -> Any:
        self.calls += 1
        group["lr"] = 1e-2 * min(1.0, self.calls / 3)
        return super()._init_group(group, *args)


COUPLED = {"counter attribute": Counted, "group counter": GroupCounted,
           "global norm": GlobalNorm, "layer decay": LayerDecay,
           "_init_group override": CountingInit}
TECHNIQUES = {"plain module": ("optimizer_in_backward",),
              "DDP": ("overlap_ddp", "optimizer_in_backward", "sharded")}


def _model(ddp: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                           nn.Linear(16, 4))
    return (DDP(module, bucket_cap_mb=0.0005) if ddp else module), module


def _set_up(technique: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    if technique == "sharded":
        return overlapkit.overlap_ddp(model, optimizer, shard_optimizer_state=True)
    return getattr(overlapkit, technique)(model, optimizer)


def _refused(rank: int, setting: str, technique: str, build: str) -> dict[str, Any]:
    """Set-up with a coupled optimizer: the error, whether it changed anything, and
    whether the model is then set up again with a torch optimizer and trained."""
    model, module = _model(setting == "DDP")
    optimizer = COUPLED[build](module.parameters())
    before = (values(module), dict(vars(optimizer)), [dict(g) for g in optimizer.param_groups])
    error = error_of(lambda: _set_up(technique, model, optimizer))
    after = (values(module), dict(vars(optimizer)), [dict(g) for g in optimizer.param_groups])
    unchanged = (bool(compare(before[0], after[0])) and not optimizer.state
                 and all(p.grad is None for p in module.parameters())
                 and before[1].keys() == after[1].keys()
                 and all(before[1][k] is after[1][k] for k in before[1]
                         if k not in ("state", "param_groups"))
                 and before[2] == after[2])
    again = error_of(lambda: _train_once(rank, model, _set_up(
        technique, model, torch.optim.AdamW(module.parameters(), lr=1e-2))))
    return {"error": error, "unchanged": unchanged, "again": again}


def _train_once(rank: int, model: nn.Module, opt: Any) -> None:
    model(rank_batches(rank, 1, (8, 16))[0]).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    opt.release()


def _trained(rank: int, setting: str, technique: str | None) -> dict[str, Any]:
    """``STEPS`` steps of ``Momentum`` (per parameter): the values and state."""
    model, module = _model(setting == "DDP")
    optimizer = Momentum(module.parameters())
    opt: Any = optimizer if technique is None else _set_up(technique, model, optimizer)

    def loop() -> None:
        for x in rank_batches(rank, STEPS, (8, 16)):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    error = error_of(loop)
    state = ([] if technique == "sharded" else
             [optimizer.state[p]["m"] for p in module.parameters()])
    if technique is not None:
        opt.release()
    return {"error": error, "values": values(module), "state": state}


def run(rank: int, world_size: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for setting, techniques in TECHNIQUES.items():
        if setting != "DDP" and rank:
            continue
        plain = _trained(rank, setting, None)
        for technique in techniques:
            for build in COUPLED:
                out[setting, technique, build] = _refused(rank, setting, technique, build)
            found = _trained(rank, setting, technique)
            found["bitwise"] = bool(compare(plain["values"], found["values"])) and (
                technique == "sharded" or bool(compare(plain["state"], found["state"])))
            out[setting, technique, "per parameter"] = found
    return out
