"""Loading a checkpoint into a model and optimizer, resharded to the current mesh."""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner

from overlapkit.checkpoint.arguments import (
    check_load_planner,
    check_model_and_optimizer,
    check_path,
)
from overlapkit.checkpoint.integrity import verify_files
from overlapkit.checkpoint.metadata import SafeFileSystemReader, read_metadata
from overlapkit.checkpoint.optimizer_state import allocate_optimizer_state
from overlapkit.checkpoint.planners import SafeLoadPlanner, resolve_load_planner
from overlapkit.checkpoint.state_dicts import (
    MODEL_KEY,
    OPTIMIZER_KEY,
    converted_dcp_errors,
    load_into,
    state_dicts,
)
from overlapkit.checkpoint.validation import check_against_metadata
from overlapkit.errors import CheckpointError
from overlapkit.optimizer_wrapper import unwrapped

__all__ = ["load"]


def load(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    planner: LoadPlanner | str | None = None,
) -> None:
    """Load a checkpoint written by :func:`~overlapkit.checkpoint.save` into ``model``
    and ``optimizer``, in place, resharded to the current world size and mesh.

    Call it on every rank, after the model is wrapped (DDP, FSDP1, FSDP2, FSDP + TP or
    plain) and the optimizer is created. The saving run's world size and mesh do not
    matter: each rank reads exactly the pieces of its own shards, from 2-D to 1-D and
    back included. Parameters and every optimizer-state tensor end up bitwise equal to
    the saved ones.

    Before anything is read the checkpoint's metadata (read without unpickling arbitrary
    objects) is compared with the model and optimizer, so a mismatch is one clear
    :class:`~overlapkit.errors.CheckpointError` on every rank rather than a traceback from
    inside DCP.

    A fresh optimizer's state tensors are created empty, with the layout its own step
    gives them, and the load writes each byte once; if the load fails, that state is
    removed again, so the optimizer is left as it was.

    :param planner: a DCP ``LoadPlanner``, the name of a registered load planner, or
        ``None`` to choose one from the model state dict's layout.
    :raises CheckpointError: an argument of the wrong type (naming it); no checkpoint at
        ``path``; a damaged file (nothing is changed); truncated or corrupt metadata;
        a checkpoint of a different model or optimizer; a tensor whose shape differs.
    :raises UnknownNameError: ``planner`` names no registered load planner.
    """
    path = check_path(path, "load")
    check_model_and_optimizer(model, optimizer, "load")
    check_load_planner(planner, "load")
    metadata = read_metadata(path)
    _verify_on_rank_zero(path, metadata)
    with unwrapped(optimizer) if optimizer is not None else nullcontext() as real:
        _load_into_real(path, metadata, model, real, planner)


def _verify_on_rank_zero(path: Path, metadata: Metadata) -> None:
    """Check the files against the manifest written at save, once (rank 0), and raise
    the same CheckpointError on every rank if any is damaged."""
    error: str | None = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            verify_files(path, metadata.storage_data)
        except CheckpointError as exc:
            error = str(exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        outcome = [error]
        dist.broadcast_object_list(outcome, src=0)
        error = outcome[0]
    if error is not None:
        raise CheckpointError(error)


def _read_values_first(path: Path, metadata: Metadata, flat: dict[str, Any]) -> None:
    """Read every non-tensor entry (param-group settings, counters) into scratch before
    any tensor is read: a hostile or damaged entry is refused while the destination
    tensors are still untouched. The entries are small; they are read again by the
    main pass."""
    values = {key: None for key, value in flat.items()
              if not isinstance(value, (torch.Tensor, ShardedTensor))}
    if not values:
        return
    reader = SafeFileSystemReader(path, metadata=metadata)
    converted_dcp_errors("reading the settings in the checkpoint at", path,
                         lambda: dcp.load(values, storage_reader=reader,
                                          planner=SafeLoadPlanner()))


def follow_saved_group_keys(optim_state_dict: dict[str, Any], metadata: Metadata) -> None:
    """Make each param group hold the hyperparameter keys its saved group holds.

    torch's ``Optimizer.load_state_dict`` replaces each group by the saved one (keeping
    only ``params``), so a group key that only one side has is not an error: an LR
    scheduler adds ``initial_lr`` to the groups, and the usual resume — build the
    optimizer, load, then build the scheduler (or the other way round) — has it on one
    side only. Keys the checkpoint holds get a placeholder DCP reads into; keys it
    does not are dropped, as torch drops them. Groups missing on either side are left
    to :func:`check_against_metadata`, which names them.
    """
    prefix = f"{OPTIMIZER_KEY}.param_groups."
    saved: dict[str, set[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(prefix):
            index, _, name = key[len(prefix):].partition(".")
            if name and "." not in name:
                saved.setdefault(index, set()).add(name)
    for position, group in enumerate(optim_state_dict.get("param_groups", [])):
        names = saved.get(str(position))
        if names is None:
            continue
        for name in names - set(group):
            group[name] = None
        for name in set(group) - names - {"params"}:
            del group[name]


def skip_state_never_saved(optim_state_dict: dict[str, Any], metadata: Metadata) -> bool:
    """Leave out of the load the state of parameters that had none when saved.

    A parameter that never got a gradient (an unused head, BERT's pooler) has no
    optimizer state; loading gives it none either — torch's ``load_state_dict``
    replaces the whole state — so the resumed run equals the uninterrupted one. Only a
    parameter with no entry at all in the checkpoint is skipped: one whose state is
    partly there is a different optimizer, which :func:`check_against_metadata` names.
    Returns whether any was skipped.
    """
    prefix = f"{OPTIMIZER_KEY}.state."
    saved = {key[len(prefix):] for key in metadata.state_dict_metadata
             if key.startswith(prefix)}
    state = optim_state_dict.get("state", {})
    never_saved = [fqn for fqn in state if not any(key.startswith(f"{fqn}.") for key in saved)]
    for fqn in never_saved:
        del state[fqn]
    return bool(never_saved)


def _load_into_real(path: Path, metadata: Metadata, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None,
                    planner: LoadPlanner | str | None) -> None:
    created = optimizer is not None and allocate_optimizer_state(optimizer)
    try:
        state = state_dicts(model, optimizer)
        skipped = False
        if optimizer is not None:
            follow_saved_group_keys(state[OPTIMIZER_KEY], metadata)
            skipped = skip_state_never_saved(state[OPTIMIZER_KEY], metadata)
        flat, _ = flatten_state_dict(state)
        check_against_metadata(flat, metadata, path=path, model_key=MODEL_KEY,
                               optimizer_key=OPTIMIZER_KEY if optimizer is not None else None)
        _read_values_first(path, metadata, flat)
        _, chosen = resolve_load_planner(planner, state[MODEL_KEY])
        reader = SafeFileSystemReader(path, metadata=metadata)
        converted_dcp_errors("loading the checkpoint at", path,
                             lambda: dcp.load(state, storage_reader=reader, planner=chosen))
        load_into(model, optimizer, state, partial_optimizer_state=skipped)
    except BaseException:
        if created:
            assert optimizer is not None
            optimizer.state.clear()  # its state was created here, uninitialised
        raise
