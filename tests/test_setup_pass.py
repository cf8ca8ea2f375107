"""The set-up of ``overlap_ddp`` is one pass: resolve, check, build.

Following the DDP model through ``overlap_ddp``'s set-up (a real 1-rank gloo DDP model),
every Python call inside the ``overlapkit`` package whose arguments hold the model (the
object itself, or a field of an attrs record passed as an argument, ``self`` included)
is a *stay*; its
module is the *room*. A set-up that works the same facts out again at each layer stays
often and keeps coming back to rooms it had left (0.3: 24 stays in 9 rooms, 15 returns;
issue 32). Run this file with ``-s`` to see the figures.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import attrs
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import overlapkit
from overlapkit.distributed import run_distributed

PACKAGE = str(Path(overlapkit.__file__).parent)
#: the ceilings of issue 32
MOST_STAYS = 12
MOST_RETURNS = 4


def _holds(value: Any, model: Any, depth: int = 3) -> bool:
    """``value`` is the model, or an attrs record holding it in a field (records
    inside records too, a few levels deep)."""
    if value is model:
        return True
    if depth and attrs.has(type(value)):
        return any(_holds(getattr(value, field.name, None), model, depth - 1)
                   for field in attrs.fields(type(value)))
    return False


def _arguments(frame: FrameType) -> list[Any]:
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
    values = []
    for name in code.co_varnames[:count]:
        value = frame.f_locals.get(name)
        if isinstance(value, tuple):
            values.extend(value)
        elif isinstance(value, dict) and name == code.co_varnames[count - 1] \
                and code.co_flags & 0x08:
            values.extend(value.values())
        else:
            values.append(value)
    return values


def _room(frame: FrameType) -> str:
    path = Path(frame.f_code.co_filename).relative_to(PACKAGE).with_suffix("")
    return ".".join(("overlapkit", *path.parts))


def trace_setup(model: Any, set_up: Callable[[], Any]) -> list[tuple[str, str]]:
    """``(room, function)`` of every call inside overlapkit made by ``set_up()`` whose
    arguments hold ``model``, in call order."""
    stays: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        if any(_holds(value, model) for value in _arguments(frame)):
            stays.append((_room(frame), frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        set_up()
    finally:
        sys.setprofile(None)
    return stays


def figures(stays: list[tuple[str, str]]) -> dict[str, Any]:
    """Stays, rooms, and how often the walk comes back to a room it had left."""
    walk: list[str] = []
    for room, _ in stays:
        if not walk or walk[-1] != room:
            walk.append(room)
    returns = sum(room in walk[:index] for index, room in enumerate(walk))
    return {"stays": len(stays), "rooms": len(set(walk)), "returns": returns,
            "walk": walk, "calls": [f"{room}.{name}" for room, name in stays]}


#: how each case calls the technique on ``model``
CASES: dict[str, Callable[[Any], Any]] = {
    "plain": lambda model: overlapkit.overlap_ddp(model, torch.optim.AdamW, lr=0.01),
    "sharded": lambda model: overlapkit.overlap_ddp(model, torch.optim.AdamW, lr=0.01,
                                                    shard_optimizer_state=True),
    "params": lambda model: overlapkit.overlap_ddp(
        model, torch.optim.AdamW, lr=0.01, params=model.parameters(), clip_grad_norm=1.0),
    "adopted": lambda model: overlapkit.overlap_ddp(
        model, torch.optim.AdamW(model.parameters(), lr=0.01)),
    "in_backward": lambda model: overlapkit.optimizer_in_backward(
        model, torch.optim.AdamW, lr=0.01),
}


def _trace_rank(rank: int, world_size: int, case: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    return figures(trace_setup(model, lambda: CASES[case](model)))


@pytest.mark.parametrize("case", list(CASES))
def test_the_set_up_follows_the_ddp_model_through_one_pass(case: str) -> None:
    [result] = run_distributed(_trace_rank, 1, args=(case,), timeout=240)
    print(f"\n{case}: {result['stays']} stays in {result['rooms']} rooms, "
          f"{result['returns']} returns")
    print("  " + "\n  ".join(result["calls"]))
    assert result["stays"] <= MOST_STAYS, result["calls"]
    assert result["returns"] <= MOST_RETURNS, result["walk"]
    again = sorted({call for call in result["calls"] if result["calls"].count(call) > 1})
    assert again == [], "worked out again on the model (each fact once)"
