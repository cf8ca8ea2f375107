"""LR schedulers that change more than ``lr`` or step in fractions — OneCycleLR's
``cycle_momentum`` (Adam's betas), SequentialLR, ChainedScheduler,
CosineAnnealingWarmRestarts stepped with fractional epochs, one built after the first
step — drive a module stepped in backward bitwise as the plain optimizer, the lrs
(``get_last_lr()``) and betas read after each step included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import compare, rank_batches, values
from torch import nn
from torch.optim import lr_scheduler as schedulers

import overlapkit

SCHEDULERS: dict[str, Callable[[Any], Any]] = {
    "OneCycleLR cycle_momentum": lambda opt: schedulers.OneCycleLR(
        opt, max_lr=0.1, total_steps=10, cycle_momentum=True),
    "SequentialLR": lambda opt: schedulers.SequentialLR(opt, [
        schedulers.LinearLR(opt, 0.1, total_iters=2), schedulers.ExponentialLR(opt, 0.9)],
        milestones=[2]),
    "ChainedScheduler": lambda opt: schedulers.ChainedScheduler([
        schedulers.LinearLR(opt, 0.1, total_iters=2), schedulers.ExponentialLR(opt, 0.9)]),
    "CosineAnnealingWarmRestarts": lambda opt: schedulers.CosineAnnealingWarmRestarts(
        opt, T_0=2),
    "built after the first step": lambda opt: schedulers.StepLR(opt, 1, gamma=0.5),
}


def _train(overlapped: bool, name: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    opt: Any = (overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=0.05)
                if overlapped else torch.optim.AdamW(module.parameters(), lr=0.05))
    late = name == "built after the first step"
    scheduler = None if late else SCHEDULERS[name](opt)
    read = []
    for epoch, batch in enumerate(rank_batches(0, 4)):
        for i, half in enumerate(batch.chunk(2)):
            module(half).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if scheduler is None:
                scheduler = SCHEDULERS[name](opt)
            elif name == "CosineAnnealingWarmRestarts":
                scheduler.step(epoch + (i + 1) / 2)
            else:
                scheduler.step()
            read.append(torch.tensor(scheduler.get_last_lr()
                                     + [g["betas"][0] for g in opt.param_groups]))
    state = opt.state_dict()["state"]
    return values(module) + read + [v for k in sorted(state) for v in state[k].values()]


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_a_scheduler_drives_optimizer_in_backward_bitwise_as_the_plain_optimizer(
        name: str) -> None:
    result = compare(_train(False, name), _train(True, name))
    assert result, result
