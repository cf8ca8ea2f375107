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
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.tensor import DTensor

from overlapkit.checkpoint.agreement import checks_on_every_rank
from overlapkit.checkpoint.arguments import (
    check_load_planner,
    check_model_and_optimizer,
    check_path,
)
from overlapkit.checkpoint.ddp_buckets import replay_layout
from overlapkit.checkpoint.extra import read_extra
from overlapkit.checkpoint.integrity import MANIFEST_FILE, verify_files
from overlapkit.checkpoint.metadata import SafeFileSystemReader, read_metadata
from overlapkit.checkpoint.optimizer_state import allocate_optimizer_state
from overlapkit.checkpoint.plan_check import (
    check_plan_covers,
    check_read_into,
    unwatch_read_into,
    watch_read_into,
)
from overlapkit.checkpoint.planners import SafeLoadPlanner, resolve_load_planner
from overlapkit.checkpoint.state_dicts import (
    MODEL_KEY,
    OPTIMIZER_KEY,
    converted_dcp_errors,
    load_into,
    share_fqns,
    state_dicts,
)
from overlapkit.checkpoint.validation import check_against_metadata, check_param_groups
from overlapkit.nodes.lost_ranks import lost_ranks_named, note_complete_checkpoint
from overlapkit.optimizer_wrapper import local_state_params, meet_for_checkpoint, unwrapped

__all__ = ["load"]


def load(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    planner: LoadPlanner | str | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`~overlapkit.checkpoint.save` into ``model``
    and ``optimizer``, in place, resharded to the current world size and mesh.

    Call it on every rank, after the model is wrapped (DDP, FSDP1, FSDP2, FSDP + TP or
    plain) and the optimizer is created. The saving run's world size and mesh do not
    matter: each rank reads exactly the pieces of its own shards, from 2-D to 1-D and
    back included. Parameters and every optimizer-state tensor end up bitwise equal to
    the saved ones.

    All or nothing: before anything is read, the files are verified against the sizes
    and checksums recorded at save, and the checkpoint's metadata (read without
    unpickling arbitrary objects) and settings are compared with the model and
    optimizer — on every rank, and if any rank refuses, every rank raises, so a
    mismatch is one clear :class:`~overlapkit.errors.CheckpointError` everywhere rather
    than a traceback from inside DCP or a hang. A checkpoint without the file list
    (older, or written by torch's DCP) is read with a copy of the destination kept
    aside, and put back if reading fails; one whose list was deleted (overlapkit's
    other files are there) is refused as damaged.

    To resume from the newest complete checkpoint whatever instant a save was killed
    at, ask :func:`~overlapkit.checkpoint.latest` first, which also makes every rank
    agree.

    A fresh optimizer's state tensors are created empty, with the layout its own step
    gives them, and the load writes each byte once; if the load fails, that state is
    removed again, so the optimizer is left as it was.

    :param planner: a DCP ``LoadPlanner``, the name of a registered load planner, or
        ``None`` to choose one from the model state dict's layout.
    :return: the ``extra`` saved with the checkpoint (``{}`` when none was): the
        caller's own progress, e.g. ``{"step": ..., "scheduler": ...}``.
    :raises CheckpointError: an argument of the wrong type (naming it); no checkpoint at
        ``path``; a damaged file (nothing is changed); truncated or corrupt metadata;
        a checkpoint of a different model or optimizer (class, settings or parameter
        groups); a tensor whose shape differs; any of these on another rank.
    :raises UnknownNameError: ``planner`` names no registered load planner.
    :raises RanksLostError: ranks were lost while loading; the message names them.
    """
    with lost_ranks_named(f"loading the checkpoint at {path}"):
        return _load(path, model, optimizer, planner)


def _load(path: str | os.PathLike[str], model: torch.nn.Module,
          optimizer: torch.optim.Optimizer | None, planner: LoadPlanner | str | None
          ) -> dict[str, Any]:
    if optimizer is not None and isinstance(optimizer, torch.optim.Optimizer):
        # a sharded optimizer's ranks meet first: refused at once where some train on
        meet_for_checkpoint(optimizer, loading=True)
    with checks_on_every_rank("load"):
        directory = check_path(path, "load")
        check_model_and_optimizer(model, optimizer, "load")
        check_load_planner(planner, "load")
        metadata = read_metadata(directory)
        # every rank checksums a share of the files (they are shared), in parallel
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        unchanged = (" Nothing was loaded: the model and optimizer are as they were."
                     if optimizer is not None else " Nothing was loaded: the model is as it was.")
        verify_files(directory, metadata.storage_data,
                     share=dist.get_rank() if ranks > 1 else 0, shares=ranks,
                     consequence=unchanged)
    verified = (directory / MANIFEST_FILE).is_file()
    # sharded optimizer state: this rank reads its share only, whatever the saving
    # run's world size was (the checkpoint holds every share)
    share = None if optimizer is None else local_state_params(optimizer)
    with unwrapped(optimizer) if optimizer is not None else nullcontext() as real:
        _load_into_real(directory, metadata, model, real, planner, verified=verified,
                        share=share)
    # the first step after the resume sums the gradients as the uninterrupted run would
    replay_layout(directory, model)
    extra = read_extra(directory)
    note_complete_checkpoint(directory)
    return extra


def _read_values_first(path: Path, metadata: Metadata, flat: dict[str, Any]
                       ) -> dict[str, Any]:
    """Read every non-tensor entry (param-group settings and members, counters) into
    scratch, on this rank alone, before any tensor is read: a hostile or damaged entry
    is refused, and the settings can be compared with the optimizer's, while the
    destination tensors are still untouched. The entries are small; they are read
    again by the main pass."""
    values: dict[str, Any] = {key: None for key, value in flat.items()
                              if not isinstance(value, (torch.Tensor, ShardedTensor))}
    values.update({key: None for key, stored in metadata.state_dict_metadata.items()
                   if key.endswith(".params") and isinstance(stored, BytesStorageMetadata)})
    if not values:
        return values
    reader = SafeFileSystemReader(path, metadata=metadata)
    converted_dcp_errors("reading the settings in the checkpoint at", path,
                         lambda: dcp.load(values, storage_reader=reader,
                                          planner=SafeLoadPlanner(), no_dist=True))
    return values


def _local_tensors(flat: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a load writes into: each plain tensor, each DTensor's local shard,
    each ShardedTensor's local shards."""
    tensors: list[torch.Tensor] = []
    for value in flat.values():
        if isinstance(value, ShardedTensor):
            tensors += [shard.tensor for shard in value.local_shards()]
        elif isinstance(value, DTensor):
            tensors.append(value.to_local())
        elif isinstance(value, torch.Tensor):
            tensors.append(value)
    return tensors


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
                    planner: LoadPlanner | str | None, *, verified: bool,
                    share: set[int] | None = None) -> None:
    created: list[torch.Tensor] = []
    try:
        with checks_on_every_rank("load"):
            if optimizer is not None:
                created = allocate_optimizer_state(optimizer, only=share)
            state = state_dicts(model, optimizer, only=share)
            skipped = False
            if optimizer is not None:
                follow_saved_group_keys(state[OPTIMIZER_KEY], metadata)
                skipped = skip_state_never_saved(state[OPTIMIZER_KEY], metadata)
            flat, _ = flatten_state_dict(state)
            others: list[str] = []
            if optimizer is not None and share is not None:  # the other ranks' shares
                every = {id(p) for group in optimizer.param_groups for p in group["params"]}
                others = [f"{OPTIMIZER_KEY}.state.{fqn}" for fqn in
                          share_fqns(model, every) - share_fqns(model, share)]
            check_against_metadata(flat, metadata, path=path, model_key=MODEL_KEY,
                                   optimizer_key=OPTIMIZER_KEY if optimizer else None,
                                   others=others)
            values = _read_values_first(path, metadata, flat)
            if optimizer is not None:
                check_param_groups(values, metadata, state[OPTIMIZER_KEY]["param_groups"],
                                   optimizer.defaults, path=path, optimizer_key=OPTIMIZER_KEY)
            name, chosen = resolve_load_planner(planner, state[MODEL_KEY])
            if name != "custom":  # a registered (a plugin's) planner: its plan checked
                check_plan_covers(chosen, name, state, flat, metadata, path=path,
                                  coordinator=not dist.is_initialized() or dist.get_rank() == 0)
        # Verified files read as they were saved; others may fail partway through, so
        # what they are read into is kept aside first (the price: a second copy). So
        # does a plugin's planner, which may raise midway or read into copies it drops.
        plugin = name != "custom" and not type(chosen).__module__.startswith("overlapkit.")
        kept = ([] if verified and not plugin
                else [(t, t.detach().clone()) for t in _local_tensors(flat)])
        dropped = watch_read_into(chosen) if plugin else []
        try:
            reader = SafeFileSystemReader(path, metadata=metadata)
            converted_dcp_errors("loading the checkpoint at", path,
                                 lambda: dcp.load(state, storage_reader=reader,
                                                  planner=chosen))
            check_read_into(chosen, name, dropped, path=path)
            load_into(model, optimizer, state,
                      partial_optimizer_state=skipped or share is not None)
        except BaseException:
            with torch.no_grad():
                for tensor, copy in kept:
                    tensor.copy_(copy)
            raise
        finally:
            unwatch_read_into(chosen)
    except BaseException:
        if optimizer is not None:
            for param in created:  # created here, uninitialised
                optimizer.state.pop(param, None)
        raise
