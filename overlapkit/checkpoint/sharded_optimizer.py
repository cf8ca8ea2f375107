"""``load_sharded_optimizer_state_dict``: torch's seed function, right for every layout.

torch's ``torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict``
chunks every optimizer-state tensor over the whole world along dim 0 unless the model
state dict holds *nested* ``ShardedTensor`` s. In torch 2.13 a 2-D FSDP1 + TP model's
state dict holds ``DTensor`` s instead, so on such a model it reads the wrong slices and
returns wrong values without an error (measured; see ``tests/test_checkpoint_2d.py``).
It also allocates each full tensor before chunking it, goes through the deprecated
``load_state_dict``, and warns three deprecations.

This version gives each optimizer-state tensor the layout of the parameter it belongs
to, taken from ``model_state_dict``: a ``DTensor`` gets the same mesh and placements
(any mesh, any placements), a ``ShardedTensor`` the same shards, a nested
``ShardedTensor`` (legacy 2-D) the tensor-parallel slice read at its offset, a plain
tensor the full tensor. State that is not shaped like its parameter (``step``) is
loaded whole. Only the local shard is ever allocated.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor

from overlapkit.checkpoint.metadata import SafeFileSystemReader
from overlapkit.checkpoint.planners import resolve_load_planner
from overlapkit.checkpoint.state_dicts import converted_dcp_errors
from overlapkit.errors import CheckpointError

__all__ = ["load_sharded_optimizer_state_dict"]


def _safe_reader(storage_reader: StorageReader) -> StorageReader:
    # torch's own FileSystemReader unpickles the metadata with pickle.load; read the same
    # directory through the safe reader instead. Other readers are used as given.
    if type(storage_reader) is FileSystemReader:
        return SafeFileSystemReader(storage_reader.path)
    return storage_reader


def _read_metadata(storage_reader: StorageReader) -> Metadata:
    try:
        return storage_reader.read_metadata()
    except CheckpointError:
        raise
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"no checkpoint metadata where the storage reader looks ({exc}); check the "
            "path given to the storage reader."
        ) from exc


def _like(template: Any, dtype: torch.dtype) -> torch.Tensor | None:
    """An empty tensor with ``template``'s global shape and layout, or ``None`` for a
    layout that needs the offset planner (nested ``ShardedTensor``)."""
    if isinstance(template, DTensor):
        local = torch.empty(template.to_local().shape, dtype=dtype,
                            device=template.to_local().device)
        return DTensor.from_local(local, template.device_mesh, template.placements,
                                  run_check=False, shape=template.size(),
                                  stride=template.stride())
    if isinstance(template, ShardedTensor):
        shards = template.local_shards()
        if shards and isinstance(shards[0].tensor, ShardedTensor):
            return None
        metadata = template.metadata()
        metadata = dataclasses.replace(
            metadata, tensor_properties=dataclasses.replace(
                metadata.tensor_properties, dtype=dtype, requires_grad=False))
        local_shards = [
            Shard(torch.empty(s.metadata.shard_sizes, dtype=dtype, device=s.tensor.device),
                  s.metadata)
            for s in shards
        ]
        return _sharded_tensor(local_shards, metadata, template._process_group)
    return torch.empty(template.size(), dtype=dtype, device=template.device)


def _sharded_tensor(local_shards: list[Shard], metadata: Any, process_group: Any
                    ) -> ShardedTensor:
    with warnings.catch_warnings():
        # The model already holds ShardedTensors; warning again for its optimizer state
        # on every load would only repeat what the user was told.
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards, metadata, process_group=process_group
        )


def _tensor_parallel_slice(template: ShardedTensor, stored: TensorStorageMetadata
                           ) -> tuple[ShardedTensor, Sequence[int]]:
    """The legacy 2-D layout: allocate the local tensor-parallel slice chunked over the
    data-parallel group (as FSDP1 did), and return the slice's offset."""
    outer = template.local_shards()[0]
    inner = cast(ShardedTensor, outer.tensor)
    dp_group = inner._process_group
    size = torch.Size(outer.metadata.shard_sizes)
    dp_ranks = dist.get_process_group_ranks(dp_group)
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{i}/cpu" for i in range(len(dp_ranks))])
    if inner.local_shards() and inner.local_shards()[0].tensor.device.type != "cpu":
        device = inner.local_shards()[0].tensor.device
        spec = ChunkShardingSpec(dim=0, placements=[f"rank:{i}/{device}"
                                                    for i in range(len(dp_ranks))])
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    metadata = spec.build_metadata(size, TensorProperties(dtype=stored.properties.dtype))
    rank = dist.get_rank(dp_group)
    shards = [
        Shard(torch.empty(md.shard_sizes, dtype=stored.properties.dtype), md)
        for md in metadata.shards_metadata
        if md.placement is not None and md.placement.rank() == rank
    ]
    return _sharded_tensor(shards, metadata, dp_group), outer.metadata.shard_offsets


def load_sharded_optimizer_state_dict(
    model_state_dict: dict[str, Any],
    optimizer_key: str,
    storage_reader: StorageReader,
    planner: LoadPlanner | str | None = None,
) -> dict[str, Any]:
    """Load the optimizer state saved under ``optimizer_key``, sharded like the model.

    A drop-in replacement for torch's
    ``torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict`` (same
    signature and result: ``{optimizer_key: {"state": ..., "param_groups": ...}}``, to
    pass through ``FSDP.optim_state_dict_to_load``), correct for ``ShardedTensor`` and
    ``DTensor`` model state dicts, 1-D and 2-D, at any world size.

    :param model_state_dict: the model's sharded state dict (e.g. FSDP1's
        ``SHARDED_STATE_DICT`` or DCP's ``get_model_state_dict``); its tensors give each
        optimizer-state tensor its layout.
    :param optimizer_key: the top-level key the optimizer state was saved under.
    :param storage_reader: where to read; torch's ``FileSystemReader`` is replaced by
        :class:`~overlapkit.checkpoint.metadata.SafeFileSystemReader` on the same path.
    :param planner: a DCP ``LoadPlanner``, a registered load planner's name, or ``None``
        to choose from the layout (``offset_2d`` for nested ``ShardedTensor`` s, else
        ``default``).
    :raises CheckpointError: no checkpoint, corrupt metadata, or no ``optimizer_key`` in
        the checkpoint.
    """
    storage_reader = _safe_reader(storage_reader)
    metadata = _read_metadata(storage_reader)
    if isinstance(storage_reader, SafeFileSystemReader):
        storage_reader._metadata = metadata  # read once, not again inside dcp.load
    planner_data = metadata.planner_data or {}
    state_dict: dict[str, Any] = {}
    fqn_to_offset: dict[str, Sequence[int]] = {}
    for key, stored in metadata.state_dict_metadata.items():
        key_path = planner_data.get(key, (key,))
        if key_path[0] != optimizer_key:
            continue
        if isinstance(stored, BytesStorageMetadata):
            state_dict[key] = "<bytes_io>"
            continue
        assert isinstance(stored, TensorStorageMetadata)
        dtype = stored.properties.dtype
        template = (model_state_dict.get(key_path[2])
                    if len(key_path) >= 4 and key_path[1] == "state" else None)
        fits = (isinstance(template, torch.Tensor) and stored.size.numel() > 1
                and tuple(template.size()) == tuple(stored.size))
        if not fits:
            state_dict[key] = torch.empty(stored.size, dtype=dtype)
            continue
        like = _like(template, dtype)
        if like is None:
            like, offset = _tensor_parallel_slice(cast(ShardedTensor, template), stored)
            fqn_to_offset[key] = offset
        state_dict[key] = like
    if not state_dict:
        tops = sorted({str(planner_data.get(k, (k,))[0]) for k in metadata.state_dict_metadata})
        raise CheckpointError(
            f"the checkpoint has no optimizer state under {optimizer_key!r}; its top-level "
            f"keys are {tops}. Pass the key the optimizer state was saved under."
        )
    options = {"fqn_to_offset": fqn_to_offset} if fqn_to_offset else {}
    _, chosen = resolve_load_planner(planner, model_state_dict, **options)
    converted_dcp_errors(
        "loading the optimizer state from", getattr(storage_reader, "path", storage_reader),
        lambda: dcp.load(state_dict, storage_reader=storage_reader, planner=chosen),
    )
    return unflatten_state_dict(state_dict, planner_data)
