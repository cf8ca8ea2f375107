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

While it loads, :func:`watch_read_into` notes each entry whose ``resolve_tensor``
returned a tensor that is not the destination's storage (a clone, a float16 copy) when
the planner keeps DCP's ``commit_tensor``, which writes nothing back: the entry would
keep its value while the rest loads (be7423f: loaded with no error, the model's tensors
as they were and the optimizer's ``lr`` the saved one). :func:`check_read_into` refuses
that after reading, and the caller puts back what was read (a registered planner's
load keeps the destination aside, as a failure of the planner's own midway must change
nothing too).

A planner passed as an instance (``planner=MyPlanner()``) is the caller's own choice
and is used as DCP would use it, unchecked (a partial load on purpose is allowed).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor

from overlapkit.errors import CheckpointError

__all__ = ["check_plan_covers", "check_read_into", "unwatch_read_into", "watch_read_into"]


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


def _same_storage(a: torch.Tensor, b: Any) -> bool:
    try:
        return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    except Exception:  # a destination without one storage (a DTensor): not judged
        return True


def watch_read_into(planner: LoadPlanner) -> list[str]:
    """Note, while ``planner`` loads, the entries its ``resolve_tensor`` reads into a
    tensor that is not their destination's, if its ``commit_tensor`` is DCP's (which
    writes nothing back); returns the list the notes go into (see the module)."""
    dropped: list[str] = []
    if (not isinstance(planner, DefaultLoadPlanner)
            or type(planner).commit_tensor is not DefaultLoadPlanner.commit_tensor):
        return dropped
    resolve = planner.resolve_tensor

    def resolve_watched(read_item: ReadItem) -> torch.Tensor:
        tensor = resolve(read_item)
        try:
            destination = planner.lookup_tensor(read_item.dest_index)
        except Exception:  # an entry DCP's lookup does not find: not judged
            return tensor
        if not _same_storage(tensor, destination):
            dropped.append(read_item.dest_index.fqn)
        return tensor

    resolve_watched.__overlapkit_watched__ = True  # type: ignore[attr-defined]
    planner.resolve_tensor = resolve_watched  # type: ignore[method-assign]
    return dropped


def unwatch_read_into(planner: LoadPlanner) -> None:
    """Give ``planner`` back its own ``resolve_tensor`` after the load: a plugin may hand
    out one planner instance for every load, which would otherwise gather a watcher per
    load."""
    if getattr(vars(planner).get("resolve_tensor"), "__overlapkit_watched__", False):
        del planner.resolve_tensor


def check_read_into(planner: LoadPlanner, name: str, dropped: list[str], *,
                    path: Path) -> None:
    """Refuse the load :func:`watch_read_into` saw read into tensors it drops.

    :raises CheckpointError: naming the planner and the entries; the caller puts back
        what was read.
    """
    if not dropped:
        return
    kind = f"{type(planner).__module__}.{type(planner).__qualname__}"
    raise CheckpointError(
        f"load: the load planner {name!r} ({kind}) read {len(dropped)} tensors of the "
        f"checkpoint at {path} into tensors it then dropped ({_listed(sorted(set(dropped)))}"
        "): its resolve_tensor returned a copy (not the destination or a view of it) and "
        "its commit_tensor, DCP's, writes nothing back, so those entries would have kept "
        "the values they have now. Nothing was loaded: the model and optimizer are as "
        "they were. Fix that planner (return a view of lookup_tensor(...) from "
        "resolve_tensor, or copy the tensor into it in commit_tensor), or load with "
        "planner='default'."
    )
