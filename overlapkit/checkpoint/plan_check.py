"""A registered load planner's plan checked before anything is read: every entry of the
state dict read, whole.

A load planner decides what DCP reads into which tensor. One registered by a plugin
(``overlapkit_register_load_planners``) and chosen by name or by its ``detect`` could
leave entries out of its plan, or read only part of a tensor: DCP then loads the rest,
and the entries left out keep the values they had, silently (f2b92e2, measured: a plugin
planner dropping ``0.weight`` loaded with no error, the model off the saved one; one
dropping the learning rates left the optimizer's ``lr`` at 0.02 where 0.01 was saved).
:func:`check_plan_covers` asks the planner for its local plan first, as DCP will, and
refuses a plan that does not read each entry of this rank's state dict exactly once
over (a tensor: as many elements as it holds here; any other value: one read), before
any tensor is written.

A planner passed as an instance (``planner=MyPlanner()``) is the caller's own choice
and is used as DCP would use it, unchecked (a partial load on purpose is allowed).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner
from torch.distributed.tensor import DTensor

from overlapkit.errors import CheckpointError

__all__ = ["check_plan_covers"]


def _elements(value: Any) -> int | None:
    """How many elements this rank reads into ``value`` (None: not a tensor)."""
    if isinstance(value, ShardedTensor):
        return sum(shard.tensor.numel() for shard in value.local_shards())
    if isinstance(value, DTensor):
        return int(value.to_local().numel())
    if isinstance(value, torch.Tensor):
        return value.numel()
    return None


def _listed(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def check_plan_covers(planner: LoadPlanner, name: str, state: dict[str, Any],
                      flat: dict[str, Any], metadata: Metadata, *, path: Path,
                      coordinator: bool) -> None:
    """Refuse ``planner`` (registered as ``name``) unless its local plan for ``state``
    reads every entry of ``flat`` (``state`` flattened) whole.

    :raises CheckpointError: entries left out, read in part or more than once, or
        entries read that the state dict does not hold; nothing was loaded.
    """
    planner.set_up_planner(state, metadata, coordinator)
    read: dict[str, int] = {}
    for item in planner.create_local_plan().items:
        fqn = item.dest_index.fqn
        count = 1 if item.type == LoadItemType.BYTE_IO else math.prod(item.lengths)
        read[fqn] = read.get(fqn, 0) + count
    left_out, partly, unknown = [], [], sorted(set(read) - set(flat))
    for key, value in flat.items():
        expected = _elements(value)
        got = read.get(key)
        if got is None and expected != 0:
            left_out.append(key)
        elif got is not None and got != (1 if expected is None else expected):
            partly.append(f"{key!r} ({got} of {1 if expected is None else expected} "
                          "elements)")
    if not (left_out or partly or unknown):
        return
    wrong = []
    if left_out:
        wrong.append(f"leaves out {len(left_out)} entries ({_listed(left_out)}), which "
                     "would keep the values they have now")
    if partly:
        wrong.append(f"reads {len(partly)} tensors in part or more than once "
                     f"({', '.join(partly[:5])})")
    if unknown:
        wrong.append(f"reads entries this state dict does not hold ({_listed(unknown)})")
    raise CheckpointError(
        f"load: the load planner {name!r} ({type(planner).__module__}."
        f"{type(planner).__qualname__}) plans to load the checkpoint at {path} wrong: it "
        f"{'; it '.join(wrong)}. Nothing was loaded: the model and optimizer are as they "
        "were. Fix that planner (or its plugin), or load with planner='default'; to "
        "load part of a checkpoint on purpose, pass a planner instance (used unchecked, "
        "as torch.distributed.checkpoint uses it)."
    )
