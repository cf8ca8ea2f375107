"""Reading a DCP checkpoint's ``.metadata`` without unpickling arbitrary objects.

DCP stores a checkpoint's metadata as a pickle, and ``FileSystemReader.read_metadata``
loads it with ``pickle.load``: a checkpoint from an untrusted source could run any code
when it is loaded. :class:`SafeUnpickler` resolves only the classes DCP metadata is made
of (listed in :data:`ALLOWED_GLOBALS`, found by reading
``torch/distributed/checkpoint/metadata.py`` and real ``.metadata`` files) and refuses
anything else with a :class:`~overlapkit.errors.CheckpointError`.
:class:`SafeFileSystemReader` is a ``FileSystemReader`` that reads its metadata this way,
so ``dcp.load`` itself never unpickles the file unsafely, and reads tensor data
straight into the destination tensors where it can (see
:mod:`overlapkit.checkpoint.reading`).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from overlapkit.errors import CheckpointError

__all__ = [
    "ALLOWED_GLOBALS",
    "METADATA_FILE",
    "SafeFileSystemReader",
    "SafeUnpickler",
    "find_checkpoint",
    "read_metadata",
]

#: the file that makes a directory a DCP checkpoint
METADATA_FILE = ".metadata"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"

#: module -> names the metadata unpickler may resolve; torch dtypes are allowed besides
ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset({
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex",
        "StorageMeta", "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "PureWindowsPath",
                          "WindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the classes DCP metadata needs.

    Every allowed class only stores the values it is given (dataclasses, ``torch.Size``,
    an enum, path objects); none runs code chosen by the file.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointError(
            f"the checkpoint metadata refers to {module}.{name}, which DCP metadata never "
            "contains; overlapkit refuses to unpickle it because a crafted checkpoint can "
            "run code this way. Load only checkpoints you trust were written by DCP; if "
            "this one was written by a custom DCP planner, read it with torch directly."
        )


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory ``path``, checked to hold a ``.metadata`` file.

    :raises CheckpointError: there is no checkpoint at ``path``; the message mentions a
        previous checkpoint left aside by a save interrupted while swapping, if any.
    """
    directory = Path(path)
    if (directory / METADATA_FILE).is_file():
        return directory
    saving = directory.parent / f".{directory.name}.saving"
    aside = directory.parent / f".{directory.name}.old"
    hint = ""
    if (saving / ".overlapkit-files.json").is_file() or (aside / METADATA_FILE).is_file():
        where = saving if (saving / ".overlapkit-files.json").is_file() else aside
        hint = (f" A save was interrupted while moving the new checkpoint into place; a "
                f"complete checkpoint is at {where}: overlapkit.checkpoint.latest"
                f"({str(directory)!r}) moves the newest one to {directory} and returns "
                "the path to load (the next overlapkit.checkpoint.save does so too).")
    if directory.is_dir():
        what = f"{directory} is a directory without a {METADATA_FILE} file"
    elif directory.exists():
        what = f"{directory} is a file, not a checkpoint directory"
    else:
        what = f"no checkpoint at {directory}: the path does not exist"
    raise CheckpointError(
        f"{what}.{hint or ' Check the path, or write one with overlapkit.checkpoint.save.'}"
    )


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """The checkpoint's metadata, unpickled with :class:`SafeUnpickler`.

    :raises CheckpointError: no checkpoint at ``path``, a truncated or corrupt metadata
        file, or metadata that refers to a class DCP metadata never contains.
    """
    file = find_checkpoint(path) / METADATA_FILE
    return _unpickle_metadata(file.read_bytes(), file)


def _unpickle_metadata(data: bytes, file: Path) -> Metadata:
    try:
        metadata = SafeUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"the checkpoint metadata {file} is truncated or corrupt ({type(exc).__name__}: "
            f"{exc}; {len(data)} bytes). The save that wrote it did not finish or the file "
            "was damaged: load an earlier checkpoint, or save again."
        ) from exc
    if not isinstance(metadata, Metadata) or not isinstance(
        metadata.state_dict_metadata, dict
    ):
        raise CheckpointError(
            f"{file} does not hold DCP checkpoint metadata (found "
            f"{type(metadata).__name__}); point at a directory written by "
            "overlapkit.checkpoint.save or torch.distributed.checkpoint.save."
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """A DCP ``FileSystemReader`` whose metadata is read with :class:`SafeUnpickler`,
    and which reads each tensor's bytes straight into its destination where the
    layouts allow (:func:`~overlapkit.checkpoint.reading.read_into`), the rest as DCP
    does.

    Pass ``metadata`` when it was already read (and validated), so the file is not
    read twice.
    """

    def __init__(self, path: str | os.PathLike[str], *, metadata: Metadata | None = None,
                 **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if self._metadata is not None and rank is None:
            metadata = self._metadata
        else:
            file = Path(self._get_metadata_path(rank))
            if not file.is_file():
                find_checkpoint(file.parent)
            metadata = _unpickle_metadata(file.read_bytes(), file)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from overlapkit.checkpoint.reading import native_byte_order, read_into

        per_file: dict[str, list[ReadItem]] = {}
        for request in plan.items:
            info = self.storage_data[request.storage_index]
            if request.type == LoadItemType.TENSOR and not info.transform_descriptors:
                per_file.setdefault(info.relative_path, []).append(request)
        direct: set[int] = set()
        for relative_path, requests in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path),
                                       "rb") as stream:
                native: bool | None = None
                for request in requests:
                    info = self.storage_data[request.storage_index]
                    if native is None:  # one writing process per file, one byte order
                        native = native_byte_order(self._slice_file(stream, info))
                    if native and read_into(stream, self._slice_file(stream, info),
                                            info.offset, info.length, request, planner):
                        direct.add(id(request))
        rest = [request for request in plan.items if id(request) not in direct]
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done
