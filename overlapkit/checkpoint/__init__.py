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

from overlapkit.checkpoint.inspection import CheckpointInfo, EntryInfo, inspect
from overlapkit.checkpoint.loading import load
from overlapkit.checkpoint.metadata import SafeFileSystemReader, SafeUnpickler, read_metadata
from overlapkit.checkpoint.planners import OffsetLoadPlanner, SafeLoadPlanner
from overlapkit.checkpoint.resuming import latest
from overlapkit.checkpoint.saving import save
from overlapkit.checkpoint.sharded_optimizer import load_sharded_optimizer_state_dict
from overlapkit.checkpoint.state_dicts import MODEL_KEY, OPTIMIZER_KEY

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
