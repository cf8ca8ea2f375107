"""What a checkpoint holds, read from its metadata alone (no tensor data is loaded)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from overlapkit.checkpoint.arguments import check_path
from overlapkit.checkpoint.integrity import verify_files
from overlapkit.checkpoint.metadata import find_checkpoint, read_metadata
from overlapkit.errors import CheckpointError

__all__ = ["CheckpointInfo", "EntryInfo", "inspect"]


@attrs.frozen(kw_only=True)
class EntryInfo:
    """One entry of a checkpoint: a tensor (with how it was sharded) or a plain value."""

    #: the flattened key, e.g. ``optimizer.state.0.weight.exp_avg``
    key: str
    #: ``tensor`` or ``value`` (a non-tensor, stored pickled by DCP)
    kind: str
    #: the global shape (empty for a value)
    shape: tuple[int, ...] = ()
    #: ``torch.float32`` ...; empty for a value
    dtype: str = ""
    #: one ``(offsets, sizes)`` pair per stored chunk: how the saving ranks sharded it
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    #: bytes this entry takes in the data files
    stored_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class CheckpointInfo:
    """A checkpoint's contents, as ``overlapkit checkpoint inspect`` shows them."""

    path: str
    entries: tuple[EntryInfo, ...]
    #: every file in the directory (data files and ``.metadata``), in bytes
    size_on_disk: int
    files: int
    dcp_version: str | None = None
    #: ``"verified"`` (every file matches the size and CRC-32 recorded at save),
    #: ``"unverified"`` (no file list: an older or torch-written checkpoint; the files
    #: are long enough for the metadata) or ``"damaged"`` (see :attr:`problem`)
    integrity: str = "unverified"
    #: what is wrong with the files, when ``integrity`` is ``"damaged"``
    problem: str | None = None

    @property
    def tensors(self) -> tuple[EntryInfo, ...]:
        return tuple(e for e in self.entries if e.kind == "tensor")

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["tensor_count"] = len(self.tensors)
        return out


def _stored_bytes(storage_data: Any) -> dict[str, int]:
    sizes: dict[str, int] = {}
    if isinstance(storage_data, dict):
        for index, info in storage_data.items():
            if isinstance(index, MetadataIndex):
                sizes[index.fqn] = sizes.get(index.fqn, 0) + int(getattr(info, "length", 0))
    return sizes


def inspect(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe the checkpoint at ``path``: every tensor's shape, dtype and stored chunks,
    every plain value, the size on disk, and whether its files are intact (checked
    against the sizes and checksums recorded at save, as :func:`load` checks them).
    Reads the (safely unpickled) metadata, and the files once for their checksums.

    :raises CheckpointError: no checkpoint at ``path``, or corrupt metadata.
    """
    directory = find_checkpoint(check_path(path, "inspect"))
    metadata = read_metadata(directory)
    try:
        integrity = "verified" if verify_files(directory, metadata.storage_data) else "unverified"
        problem = None
    except CheckpointError as damage:
        integrity, problem = "damaged", str(damage)
    stored = _stored_bytes(metadata.storage_data)
    entries = []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            chunks = tuple((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            entries.append(EntryInfo(
                key=key, kind="tensor", shape=tuple(md.size),
                dtype=str(md.properties.dtype), chunks=chunks,
                stored_bytes=stored.get(key, 0)))
        else:
            entries.append(EntryInfo(key=key, kind="value", stored_bytes=stored.get(key, 0)))
    files = [f for f in Path(directory).iterdir() if f.is_file()]
    return CheckpointInfo(
        path=str(directory), entries=tuple(entries),
        size_on_disk=sum(f.stat().st_size for f in files), files=len(files),
        dcp_version=getattr(metadata, "version", None), integrity=integrity, problem=problem,
    )
