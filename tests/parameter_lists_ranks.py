"""The rank side of tests/test_parameter_lists.py: bad parameter lists and optimizer
arguments given to overlap_ddp and optimizer_in_backward on a DDP model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


class TiedHead(nn.Module):
    """An embedding whose weight the output head shares (as GPT-2's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(tokens))))


def bad_inputs() -> dict[str, Any]:
    """Each bad input, as (technique, case) -> what it raised; the model left without
    a comm hook by every refusal (a later valid call works)."""
    body = TiedHead().body
    weight = body.weight
    cases: dict[str, Any] = {
        "twice in one group": {"params": [weight, weight]},
        "twice across groups": {"params": [{"params": [weight]},
                                           {"params": [weight], "lr": 0.5}]},
        "betas too short": {"betas": (0.9,)},
        "negative lr": {"lr": -1.0},
        "group without params": {"params": [{"lr": 0.1}]},
        "params is an int": {"params": 5},
        "params is one tensor": {"params": weight},
    }
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        torch.manual_seed(0)
        ddp = DDP(TiedHead())
        weight = ddp.module.body.weight
        for case, kwargs in cases.items():
            kwargs = {k: (_swap(v, body.weight, weight)) for k, v in kwargs.items()}
            kwargs.setdefault("lr", 0.1)
            call = getattr(overlapkit, technique)
            out[f"{technique}: {case}"] = _error_and_cause(
                lambda call=call, kwargs=kwargs, ddp=ddp: call(ddp, torch.optim.AdamW, **kwargs))
        # nothing was registered by the refusals: a valid call still works and trains
        opt = getattr(overlapkit, technique)(ddp, torch.optim.AdamW, lr=0.1)
        before = ddp.module.body.weight.detach().clone()
        ddp(torch.tensor([[1, 2, 3]])).square().mean().backward()
        opt.step()
        out[f"{technique}: valid call after refusals trains"] = not torch.equal(
            before, ddp.module.body.weight)
    return out


def _error_and_cause(call: Any) -> dict[str, Any] | None:
    """The class name and message of what ``call`` raised, and the class name of the
    error it was raised from (None: not chained), or None."""
    try:
        call()
    except Exception as error:
        cause = error.__cause__
        return {"type": type(error).__name__, "message": str(error),
                "cause": None if cause is None else type(cause).__name__}
    return None


def _swap(value: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    if value is old:
        return new
    if isinstance(value, list):
        return [_swap(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: _swap(v, old, new) for k, v in value.items()}
    return value


def run(rank: int, world_size: int) -> dict[str, Any]:
    return bad_inputs()
