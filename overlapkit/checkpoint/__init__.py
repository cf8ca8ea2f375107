"""Sharded model and optimizer-state checkpoints: save, load, reshard, inspect.

::

    from overlapkit import checkpoint
    checkpoint.save("ckpt/step-100", model, optimizer)   # every rank; atomic
    checkpoint.latest("ckpt/step-100")                   # every rank: resume? (or None)
    checkpoint.load("ckpt/step-100", model, optimizer)   # any world size or mesh
    checkpoint.inspect("ckpt/step-100")                  # what it holds, from metadata

Checkpoints are DCP directories (``torch.distributed.checkpoint``) holding
``{"model": ..., "optimizer": ...}``. Loading never unpickles arbitrary objects from
a checkpoint, validates everything against the metadata before reading, and reports
each problem as a :class:`~overlapkit.errors.CheckpointError` that says what to do; a
registered load planner's plan must read every entry whole
(:mod:`~overlapkit.checkpoint.plan_check`).
:func:`load_sharded_optimizer_state_dict` is torch's seed function with the 2-D
DTensor case fixed. See ``docs/checkpoints.rst``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from overlapkit.checkpoint.inspection import CheckpointInfo, EntryInfo, inspect
    from overlapkit.checkpoint.loading import load
    from overlapkit.checkpoint.metadata import (
        SafeFileSystemReader,
        SafeUnpickler,
        read_metadata,
    )
    from overlapkit.checkpoint.planners import OffsetLoadPlanner, SafeLoadPlanner
    from overlapkit.checkpoint.resuming import latest
    from overlapkit.checkpoint.saving import save
    from overlapkit.checkpoint.sharded_optimizer import load_sharded_optimizer_state_dict
    from overlapkit.checkpoint.state_dicts import MODEL_KEY, OPTIMIZER_KEY

#: public name -> its module, imported on first use (module ``__getattr__``): the
#: modules import ``torch.distributed.checkpoint`` (with FSDP and DTensor, 1.5-2 s of
#: CPU on torch 2.13), which the built-in plugin's registration (``checkpoint.plugin``,
#: read whenever the plugins load: every ``overlap_ddp``) and a loop that saves nothing
#: do not need
_LAZY = {
    "CheckpointInfo": "inspection", "EntryInfo": "inspection", "inspect": "inspection",
    "load": "loading",
    "SafeFileSystemReader": "metadata", "SafeUnpickler": "metadata",
    "read_metadata": "metadata",
    "OffsetLoadPlanner": "planners", "SafeLoadPlanner": "planners",
    "latest": "resuming",
    "save": "saving",
    "load_sharded_optimizer_state_dict": "sharded_optimizer",
    "MODEL_KEY": "state_dicts", "OPTIMIZER_KEY": "state_dicts",
}


def __getattr__(name: str) -> Any:
    """Import a public name on first use, and keep it (later lookups are plain)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "MODEL_KEY",
    "OPTIMIZER_KEY",
    "CheckpointInfo",
    "EntryInfo",
    "OffsetLoadPlanner",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "SafeUnpickler",
    "inspect",
    "latest",
    "load",
    "load_sharded_optimizer_state_dict",
    "read_metadata",
    "save",
]
