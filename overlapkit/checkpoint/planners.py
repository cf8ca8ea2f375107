"""DCP load planners that never unpickle arbitrary objects, and their automatic choice.

``DefaultLoadPlanner.load_bytes`` restores every non-tensor entry of a checkpoint (the
optimizer's ``param_groups`` values, for instance) with ``torch.load(weights_only=False)``,
which runs any code a crafted file contains. Both planners here load those entries
with ``weights_only=True`` (plain Python values and tensors only).

``default``
    DCP's default planner: right for every layout whose tensors know their own global
    offsets (plain tensors, ``DTensor`` on 1-D and 2-D meshes, flat ``ShardedTensor``).
``offset_2d``
    Reads each local chunk at an extra offset: the layout of the legacy 2-D FSDP1 + TP
    state dicts, whose ``ShardedTensor`` s hold the tensor-parallel slice as a nested
    ``ShardedTensor`` and so do not know where that slice starts. Chosen automatically
    when a model state dict holds a nested ``ShardedTensor``.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    create_read_items_for_chunk_list,
)

from overlapkit.errors import CheckpointError

__all__ = [
    "OffsetLoadPlanner",
    "SafeLoadPlanner",
    "has_nested_sharded_tensor",
    "resolve_load_planner",
]


def _safe_load_bytes(read_item: ReadItem, value: io.BytesIO) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"the checkpoint entry {read_item.dest_index.fqn!r} is not a plain Python value "
            f"or tensor ({type(exc).__name__}: {exc}); overlapkit does not unpickle "
            "arbitrary objects from a checkpoint. Load only checkpoints you trust, with "
            "torch.distributed.checkpoint directly."
        ) from exc


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` restoring non-tensor entries with
    ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = _safe_load_bytes(read_item, value)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class OffsetLoadPlanner(SafeLoadPlanner):
    """Reads each ``ShardedTensor`` named in ``fqn_to_offset`` at that extra offset.

    For the legacy 2-D FSDP1 + TP layout, where a tensor-parallel slice is stored as a
    nested ``ShardedTensor`` whose shard offsets are relative to the slice: the offset
    of the slice in the full tensor is added when reading and removed when writing the
    chunk back into the local shard.
    """

    def __init__(self, fqn_to_offset: Mapping[str, Sequence[int]] | None = None,
                 **options: Any) -> None:
        super().__init__(**options)
        self.fqn_to_offset = dict(fqn_to_offset or {})
        self.translation: dict[MetadataIndex, MetadataIndex] = {}

    def create_local_plan(self) -> LoadPlan:
        requests: list[ReadItem] = []
        self.translation = {}
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]  # type: ignore[union-attr]
            if not isinstance(obj, ShardedTensor) or fqn not in self.fqn_to_offset:
                requests += _create_read_items(fqn, md, obj)
                continue
            offset = self.fqn_to_offset[fqn]
            if len(obj.local_shards()) != 1:
                raise CheckpointError(
                    f"{fqn!r} has {len(obj.local_shards())} local shards; the offset_2d "
                    "planner reads exactly one per rank. Use the 'default' planner."
                )
            shard = obj.local_shards()[0].metadata
            chunk = ChunkStorageMetadata(
                offsets=torch.Size(a + b for a, b in
                                   zip(shard.shard_offsets, offset, strict=True)),
                sizes=torch.Size(shard.shard_sizes),
            )
            reads = create_read_items_for_chunk_list(
                fqn, cast(TensorStorageMetadata, md), [chunk]
            )
            for read in reads:
                assert read.dest_index.offset is not None
                local = torch.Size(a - b for a, b in
                                   zip(read.dest_index.offset, offset, strict=True))
                self.translation[read.dest_index] = dataclasses.replace(
                    read.dest_index, offset=local
                )
            requests += reads
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return super().lookup_tensor(self.translation.get(index, index))


def has_nested_sharded_tensor(state_dict: Any) -> bool:
    """Whether a (model) state dict holds a ``ShardedTensor`` nested in a
    ``ShardedTensor``: the legacy 2-D FSDP1 + TP layout."""
    if not isinstance(state_dict, Mapping):
        return False
    for value in state_dict.values():
        shards = value.local_shards() if isinstance(value, ShardedTensor) else []
        if shards and isinstance(shards[0].tensor, ShardedTensor):
            return True
    return False


def resolve_load_planner(
    planner: LoadPlanner | str | None, state_dict: Any, **options: Any
) -> tuple[str, LoadPlanner]:
    """The planner to load ``state_dict`` with, and its registered name.

    ``planner`` is an instance (used as it is, named ``"custom"``), a registered name,
    or ``None``: then the registered planners are asked in order of priority whether
    their ``detect`` accepts ``state_dict``, falling back to ``default``. ``options`` go
    to the spec's ``build``.

    :raises UnknownNameError: ``planner`` names no registered load planner.
    """
    if isinstance(planner, LoadPlanner):
        return "custom", planner
    from overlapkit.plugin.manager import get_plugin_manager

    registry = get_plugin_manager().registry
    if planner is not None:
        spec = registry.load_planner(planner)
    else:
        candidates = [s for s in registry.load_planners_by_priority()
                      if s.detect is not None and s.detect(state_dict)]
        spec = candidates[0] if candidates else registry.load_planner("default")
    return spec.name, spec.create(**options)
