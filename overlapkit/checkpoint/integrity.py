"""File integrity of a checkpoint: sizes and checksums recorded at save, verified before
anything is loaded.

``load`` reads straight into the destination tensors (that keeps its peak memory near
the local shard), so damage found while reading would leave the model half-overwritten.
A manifest written at save time — each file's size and CRC-32 — lets ``load`` find a
truncated, zeroed or overwritten file first, and refuse it with nothing changed.
Checkpoints written before the manifest existed (or by torch's DCP) get a lesser check:
each data file must be long enough for the chunks the metadata places in it.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

from overlapkit.errors import CheckpointError

__all__ = ["MANIFEST_FILE", "verify_files", "write_manifest"]

#: the manifest's file name inside a checkpoint directory
MANIFEST_FILE = ".overlapkit-files.json"
_CHUNK = 1 << 22


def _crc32(file: Path) -> int:
    crc = 0
    with file.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: Path) -> None:
    """Record the size and CRC-32 of every file in ``directory`` (rank 0, after every
    rank has written its files and before the checkpoint is moved into place)."""
    files: dict[str, Any] = {}
    for file in sorted(directory.iterdir()):
        if file.is_file() and file.name != MANIFEST_FILE:
            files[file.name] = {"size": file.stat().st_size, "crc32": _crc32(file)}
    (directory / MANIFEST_FILE).write_text(json.dumps({"version": 1, "files": files}))


def _check_extents(directory: Path, storage_data: Any) -> None:
    """Without a manifest: every file the metadata points into exists and is long
    enough to hold every chunk stored in it, so a truncated file is still refused
    before anything is read (other damage is found while reading, as DCP finds it)."""
    needed: dict[str, int] = {}
    for info in (storage_data.values() if isinstance(storage_data, dict) else ()):
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if isinstance(name, str) and isinstance(offset, int) and isinstance(length, int):
            needed[name] = max(needed.get(name, 0), offset + length)
    for name, end in sorted(needed.items()):
        file = directory / name
        if not file.is_file():
            problem = "is missing"
        elif (actual := file.stat().st_size) < end:
            problem = f"has {actual} bytes where its metadata needs {end} (truncated)"
        else:
            continue
        raise CheckpointError(
            f"the checkpoint at {directory} is damaged: its file {name} {problem}. "
            "Nothing was loaded: the model and optimizer are as they were. Load an earlier "
            "checkpoint, or save again from a run that has this state."
        )


def verify_files(directory: Path, storage_data: Any = None) -> bool:
    """Check every file the manifest lists; False when there is no manifest (a
    checkpoint of an earlier version, or written by torch's DCP), after checking the
    files' sizes against ``storage_data`` (the metadata's) instead.

    :raises CheckpointError: a file is missing, has another size, or another checksum
        (naming it and what to do).
    """
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        _check_extents(directory, storage_data)
        return False
    try:
        files = json.loads(manifest_path.read_text())["files"]
        listed = {str(name): (int(v["size"]), int(v["crc32"])) for name, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(
            f"the checkpoint at {directory} has a damaged file list ({MANIFEST_FILE}: "
            f"{error}); it cannot be verified. Load an earlier checkpoint. Nothing was "
            "loaded."
        ) from error
    for name, (size, crc) in sorted(listed.items()):
        file = directory / name
        if not file.is_file():
            problem = "is missing"
        elif (actual := file.stat().st_size) != size:
            problem = f"has {actual} bytes where {size} were saved (truncated or appended to)"
        elif _crc32(file) != crc:
            problem = "has the size it was saved with but other contents (damaged or altered)"
        else:
            continue
        raise CheckpointError(
            f"the checkpoint at {directory} is damaged: its file {name} {problem}. "
            "Nothing was loaded: the model and optimizer are as they were. Load an earlier "
            "checkpoint, or save again from a run that has this state."
        )
    return True
