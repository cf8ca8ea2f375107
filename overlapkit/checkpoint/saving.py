"""Atomic checkpoint saves.

Every rank writes its part into a sibling directory ``.NAME.saving``; once DCP has
written the metadata (its last step), every rank checks that it sees every file of it
(:mod:`overlapkit.checkpoint.visibility`: a directory that is not shared between the
nodes fails here, on every rank), rank 0 writes the file list that marks it complete,
moves an existing checkpoint at the path aside to ``.NAME.old``, renames
``.NAME.saving`` to the path, and deletes the old one; a broadcast then lets every rank
return. A save killed at any instant leaves a complete checkpoint — the previous one,
or the new one once its file list is written — which
:func:`~overlapkit.checkpoint.latest` finds and the next save keeps
(:mod:`overlapkit.checkpoint.directories` has the table).

Rank 0 alone touches the directories; whether it succeeded is broadcast to every rank,
so a failure there (a rename refused, a directory fsync a network file system rejects)
is a :class:`~overlapkit.errors.CheckpointError` on every rank, not a hang of the others
at the next collective.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel

from overlapkit.checkpoint.agreement import checks_on_every_rank
from overlapkit.checkpoint.arguments import check_model_and_optimizer, check_path
from overlapkit.checkpoint.ddp_buckets import write_layout
from overlapkit.checkpoint.directories import (
    finish_interrupted_save,
    on_rank_zero,
    siblings,
    swap_into_place,
)
from overlapkit.checkpoint.extra import check_extra, write_extra
from overlapkit.checkpoint.integrity import write_manifest
from overlapkit.checkpoint.metadata import METADATA_FILE
from overlapkit.checkpoint.optimizer_state import remove_state_except
from overlapkit.checkpoint.state_dicts import (
    MODEL_KEY,
    OPTIMIZER_KEY,
    converted_dcp_errors,
    state_dicts,
)
from overlapkit.checkpoint.visibility import check_every_rank_sees
from overlapkit.errors import CheckpointError
from overlapkit.nodes.lost_ranks import lost_ranks_named, note_complete_checkpoint
from overlapkit.optimizer_wrapper import (
    local_state_params,
    meet_for_checkpoint,
    rewritten_unchanged,
    unwrapped,
)

__all__ = ["save"]


def _check_destination(path: Path) -> None:
    # Every rank checks, so every rank raises alike before the first collective.
    if path.is_file() or (path.is_dir() and any(path.iterdir())
                          and not (path / METADATA_FILE).is_file()):
        raise CheckpointError(
            f"{path} exists and is not a checkpoint; overlapkit.checkpoint.save replaces "
            "only a previous checkpoint. Choose another path, or remove it first."
        )


def with_rank_zero_buffers(model: torch.nn.Module,
                           model_state: dict[str, Any]) -> dict[str, Any]:
    """``model_state`` with each buffer of a DDP model replaced by rank 0's value.

    DDP with ``broadcast_buffers=True`` (its default) broadcasts rank 0's buffers at
    the start of every forward, so rank 0's BatchNorm running statistics are what an
    uninterrupted run goes on with; the other ranks' differ until then. DCP writes one
    copy of a replicated tensor, from whichever rank its planner picks, so each buffer
    is made rank 0's first — into a copy: the live buffers are left as they are. One
    broadcast per buffer, at save time only.
    """
    if not (isinstance(model, DistributedDataParallel) and model.broadcast_buffers
            and dist.is_initialized() and dist.get_world_size(model.process_group) > 1):
        return model_state
    group = model.process_group
    source = dist.get_global_rank(group, 0)
    out = dict(model_state)
    for name, _ in model.module.named_buffers():
        value = out.get(name)
        if isinstance(value, torch.Tensor):
            copy = value.detach().clone()
            dist.broadcast(copy, src=source, group=group)
            out[name] = copy
    return out


def without_created_state(state: dict[str, Any]) -> None:
    """Leave out of the checkpoint the optimizer state that was created for the save.

    A fresh optimizer (no step yet) has no state; DCP's ``get_state_dict`` gives it
    some first (Adam: ``step`` 1 and zero moments). Saved, that state would make a
    resumed run take its first step as a second one (Adam's bias correction differs), so
    the checkpoint holds none, as a parameter that never got a gradient has none; a
    load then leaves the optimizer with no state, exactly as the saving run had.
    """
    optimizer_state = state.get(OPTIMIZER_KEY)
    if isinstance(optimizer_state, dict) and "state" in optimizer_state:
        optimizer_state["state"] = {}


def save(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Save the model's and the optimizer's state as a DCP checkpoint directory.

    Call it on every rank with the same ``path`` (on a file system every rank sees).
    Works for DDP, FSDP1, FSDP2 (``fully_shard``), 2-D FSDP + TP and plain modules, and
    any ``torch.optim.Optimizer``; each rank writes only its own shards. The checkpoint
    holds ``{"model": ..., "optimizer": ...}`` as DCP's ``get_state_dict`` builds them
    (parameter names without wrapper prefixes), so
    :func:`~overlapkit.checkpoint.load` reads it back at any world size or mesh, and
    torch's DCP can read it too.

    The save is atomic: it is written aside and moved into place, so an interrupted
    save — a rank or a whole node lost half-way included — leaves the previous
    checkpoint intact, and the half-written one is never at ``path``.

    ``extra`` is the caller's own progress — the step, an LR scheduler's
    ``state_dict()`` — saved inside the checkpoint (as JSON, plain data only) and
    returned by :func:`~overlapkit.checkpoint.load`: the two are complete together or
    not at all, where a file of its own written after the checkpoint could be left
    from another step by a run killed in between (:mod:`overlapkit.checkpoint.extra`).

    The optimizer is left exactly as it was, and the checkpoint holds the state it has:
    none for a parameter that never got a gradient, and none at all for a fresh
    optimizer (no step yet), so a run resumed from it takes its first step as a first
    step, as the uninterrupted run does.

    Before the checkpoint is marked complete, every rank checks that it sees every
    file of it (:mod:`overlapkit.checkpoint.visibility`): a directory that is the same
    path on each node but each node's own disk fails here, on every rank. A save killed
    at any instant leaves a complete checkpoint, the previous one or this one, which
    :func:`~overlapkit.checkpoint.latest` finds; this save first finishes one that was
    interrupted, so it never throws a complete checkpoint away for an older one.

    :return: ``path`` as a ``Path``.
    :raises CheckpointError: ``path`` exists and is not a checkpoint, ``extra`` is not
        plain JSON data, a rank does not see every file of the checkpoint (the
        directory is not on storage every node sees), or writing or moving it into
        place failed (on every rank alike).
    :raises RanksLostError: ranks were lost while saving (the previous checkpoint is
        intact); the message names them.
    """
    with lost_ranks_named(f"saving the checkpoint to {path}"):
        return _save(path, model, optimizer, extra)


def _save(path: str | os.PathLike[str], model: torch.nn.Module,
          optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any] | None) -> Path:
    if optimizer is not None and isinstance(optimizer, torch.optim.Optimizer):
        # a sharded optimizer's ranks meet first: refused at once where some train on
        meet_for_checkpoint(optimizer, loading=False)
    with checks_on_every_rank("save"):
        path = check_path(path, "save")
        check_model_and_optimizer(model, optimizer, "save")
        checked_extra = None if extra is None else check_extra(extra)
        saving, old = siblings(path)
        _check_destination(path)

    def prepare() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        finish_interrupted_save(path)  # never throws away a newer complete checkpoint

    on_rank_zero("preparing its directory", path, prepare)
    # sharded optimizer state: this rank writes its share (the shares are disjoint)
    share = None if optimizer is None else local_state_params(optimizer)
    with unwrapped(optimizer) if optimizer is not None else nullcontext() as real:
        had_state = set() if real is None else {id(p) for p in real.state}
        try:
            versions = {id(p): p._version for p in model.parameters()}
            state = state_dicts(model, real, only=share)
            rewritten_unchanged(optimizer, versions)
            state[MODEL_KEY] = with_rank_zero_buffers(model, state[MODEL_KEY])
            if real is not None and not had_state:
                without_created_state(state)
            writer = dcp.FileSystemWriter(saving, sync_files=True)
            metadata = converted_dcp_errors("saving the checkpoint to", path,
                                            lambda: dcp.save(state, storage_writer=writer))
        finally:
            if real is not None:
                remove_state_except(real, had_state)
    # dcp.save returns on every rank only after rank 0 wrote the metadata.
    check_every_rank_sees(saving, metadata.storage_data, path)

    def record() -> None:
        if checked_extra is not None:
            write_extra(saving, checked_extra)  # before the manifest, which lists it
        write_layout(saving, model)  # DDP's bucket layout, for a bitwise resume
        write_manifest(saving)  # last: it marks the checkpoint complete

    on_rank_zero("recording the files' sizes and checksums", path, record)
    on_rank_zero("moving it into place", path, lambda: swap_into_place(path, saving, old))
    note_complete_checkpoint(path)
    return path
