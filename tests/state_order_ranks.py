"""The rank side of tests/test_state_order.py: the order of the optimizer's ``state``
entries after overlapped steps, against the plain loop's, and a loop that relies on
it (it resets the state of the first entry between steps)."""

from __future__ import annotations

from typing import Any

import torch
from helpers import compare, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 4
OPTIMIZERS: dict[str, Any] = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "SGD": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


def _model(ddp: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
    return DDP(model, bucket_cap_mb=0.002) if ddp else model


def _train(rank: int, technique: str | None, ddp: bool, optimizer: str,
           reset_first: bool) -> dict[str, Any]:
    """``STEPS`` steps; ``reset_first``: before the third, the loop removes the state
    entry listed first (``opt.state.pop(next(iter(opt.state)))``)."""
    model = _model(ddp)
    module = model.module if ddp else model
    names = {id(p): name for name, p in module.named_parameters()}
    opt: Any = OPTIMIZERS[optimizer](model.parameters())
    if technique is not None:
        opt = getattr(overlapkit, technique)(model, opt)
    for step, x in enumerate(rank_batches(rank, STEPS, (8, 16))):
        if reset_first and step == 2:
            opt.state.pop(next(iter(opt.state)))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    found = {"order": [names[id(p)] for p in opt.state],
             "saved order": list(opt.state_dict()["state"]), "values": values(module)}
    if technique is not None:
        opt.release()
    return found


def _later_branch(technique: str | None) -> list[str]:
    """A plain module whose second branch is used from the third step on: its entries
    come after the others, as the plain loop appends them."""
    torch.manual_seed(0)
    trunk, branch = nn.Linear(8, 8), nn.Linear(8, 8)
    model = nn.ModuleDict({"trunk": trunk, "branch": branch})
    names = {id(p): name for name, p in model.named_parameters()}
    opt: Any = torch.optim.AdamW([*branch.parameters(), *trunk.parameters()], lr=1e-2)
    if technique is not None:
        opt = overlapkit.optimizer_in_backward(model, opt)
    for step, x in enumerate(rank_batches(0, STEPS, (4, 8))):
        out = trunk(x)
        (branch(out) if step >= 2 else out).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    order = [names[id(p)] for p in opt.state]
    if technique is not None:
        opt.release()
    return order


SETTINGS = {"plain module": (False, ("optimizer_in_backward",)),
            "DDP": (True, ("overlap_ddp", "optimizer_in_backward"))}


def run(rank: int, world_size: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for setting, (ddp, techniques) in SETTINGS.items():
        if not ddp and rank != 0:
            continue
        for optimizer in OPTIMIZERS:
            for reset_first in (False, True):
                plain = _train(rank, None, ddp, optimizer, reset_first)
                for technique in techniques:
                    found = _train(rank, technique, ddp, optimizer, reset_first)
                    out[setting, technique, optimizer, reset_first] = {
                        "order": (found["order"], plain["order"]),
                        "saved order": (found["saved order"], plain["saved order"]),
                        "bitwise": compare(plain["values"], found["values"])}
    if rank == 0:
        out["later branch"] = (_later_branch("optimizer_in_backward"), _later_branch(None))
    return out
