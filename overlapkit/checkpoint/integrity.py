"""File integrity of a checkpoint: sizes and checksums recorded at save, verified before
anything is loaded.

``load`` reads straight into the destination tensors (that keeps its peak memory near
the local shard), so damage found while reading would leave the model half-overwritten.
A manifest written at save time — each file's size and CRC-32 — lets ``load`` find a
truncated, zeroed or overwritten file first, and refuse it with nothing changed.
A checkpoint with overlapkit's other files (``extra``, DDP's layout) but no manifest
lost it: it is refused as damaged, naming the list. Checkpoints written before the
manifest existed (or by torch's DCP) get a lesser check
— each data file must be long enough for the chunks the metadata places in it — and are
loaded with a copy of the destination kept aside, so damage found while reading still
changes nothing (see :mod:`overlapkit.checkpoint.loading`).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

from overlapkit.checkpoint.ddp_buckets import LAYOUT_FILE
from overlapkit.checkpoint.extra import EXTRA_FILE
from overlapkit.errors import CheckpointError

__all__ = ["MANIFEST_FILE", "needed_extents", "verify_files", "write_manifest"]

#: the manifest's file name inside a checkpoint directory
MANIFEST_FILE = ".overlapkit-files.json"
_WRITING = MANIFEST_FILE + ".writing"
_CHUNK = 1 << 22


def _crc32(file: Path) -> int:
    crc = 0
    with file.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: Path) -> None:
    """Record the size and CRC-32 of every file in ``directory`` (rank 0, after every
    rank has written its files and before the checkpoint is moved into place).

    The list marks the checkpoint complete (:mod:`overlapkit.checkpoint.directories`),
    so it appears whole or not at all: written beside, synced, then renamed."""
    files: dict[str, Any] = {}
    for file in sorted(directory.iterdir()):
        if file.is_file() and file.name not in (MANIFEST_FILE, _WRITING):
            files[file.name] = {"size": file.stat().st_size, "crc32": _crc32(file)}
    writing = directory / _WRITING
    with writing.open("w") as stream:
        stream.write(json.dumps({"version": 1, "files": files}))
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(writing, directory / MANIFEST_FILE)


def needed_extents(storage_data: Any) -> dict[str, int]:
    """data file name -> the end of the last chunk the metadata places in it."""
    needed: dict[str, int] = {}
    for info in (storage_data.values() if isinstance(storage_data, dict) else ()):
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if isinstance(name, str) and isinstance(offset, int) and isinstance(length, int):
            needed[name] = max(needed.get(name, 0), offset + length)
    return needed


class _Damaged(Exception):
    """A file of the checkpoint found damaged: its name and what is wrong with it."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(name, problem)
        self.name, self.problem = name, problem


#: what overlapkit's own files hold, for messages
_OWN_FILES = {
    ".metadata": "DCP's metadata: where every tensor and value is stored",
    EXTRA_FILE: "the progress saved with it (save's extra)",
    LAYOUT_FILE: "DDP's bucket layout",
    MANIFEST_FILE: "the file list: each file's size and checksum",
}


def _holds(name: str, storage_data: Any) -> str:
    """What the file ``name`` holds: overlapkit's or DCP's own file, or the entries
    the metadata stores in it (a few, and how many)."""
    if name in _OWN_FILES:
        return _OWN_FILES[name]
    tensors: list[str] = []
    values: list[str] = []
    for index, info in (storage_data.items() if isinstance(storage_data, dict) else ()):
        fqn = getattr(index, "fqn", None)
        if getattr(info, "relative_path", None) == name and isinstance(fqn, str):
            # a tensor's chunk has an offset, a pickled value none: tensors first
            into = values if getattr(index, "offset", None) is None else tensors
            if fqn not in into:
                into.append(fqn)
    keys = tensors + values
    if not keys:
        return ""
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return f"{len(keys)} entries: {', '.join(keys[:4])}{more}"


def _damaged(directory: Path, damage: _Damaged, storage_data: Any, consequence: str
             ) -> CheckpointError:
    holds = _holds(damage.name, storage_data)
    holds = f"; it holds {holds}" if holds else ""
    return CheckpointError(
        f"the checkpoint at {directory} is damaged: its file {damage.name} "
        f"{damage.problem}{holds}.{consequence} Load an earlier checkpoint, or save again from "
        "a run that has this state."
    )


def _check_extents(directory: Path, needed: dict[str, int]) -> None:
    """Every file the metadata points into exists and is long enough to hold every
    chunk stored in it, so a truncated file is refused before anything is read."""
    for name, end in sorted(needed.items()):
        file = directory / name
        if not file.is_file():
            raise _Damaged(name, "is missing")
        if (actual := file.stat().st_size) < end:
            raise _Damaged(name, f"has {actual} bytes where its metadata needs {end} "
                           "(truncated)")


def _read_manifest(directory: Path) -> dict[str, tuple[int, int]]:
    try:
        files = json.loads((directory / MANIFEST_FILE).read_text())["files"]
        return {str(name): (int(v["size"]), int(v["crc32"])) for name, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError,
            OverflowError) as error:
        raise _Damaged(MANIFEST_FILE, f"cannot be read ({type(error).__name__}: {error}), "
                       "so the others cannot be verified") from error


def verify_files(directory: Path, storage_data: Any = None, *, share: int = 0,
                 shares: int = 1, consequence: str = "") -> bool:
    """Check the checkpoint's files before anything is read from them; whether they were
    verified against a file list (False: a checkpoint of an earlier version, or written
    by torch's DCP, whose data can only be checked for length).

    Every file the metadata (``storage_data``) points into must exist and be long
    enough; with a file list, it must also be listed (a list that leaves a data file
    out verifies nothing), and every listed file must have its recorded size and
    CRC-32.

    :param share: with ``shares``: checksum only this share of the listed files
        (``load`` gives each rank one, so the ranks read the files in parallel
        rather than all of them on one rank while the others wait); sizes, the listing
        and the extents are checked in full by every share.
    :param consequence: a sentence the error adds after the damage (``load``: what was
        left unchanged).
    :raises CheckpointError: a file is missing, unlisted, unreadable, has another size,
        or another checksum; the file list is damaged (naming it and what to do).
    """
    try:
        return _verify(directory, needed_extents(storage_data), share, shares)
    except _Damaged as damage:
        raise _damaged(directory, damage, storage_data, consequence) from damage.__cause__
    except OSError as error:
        raise CheckpointError(
            f"the checkpoint at {directory} cannot be read ({type(error).__name__}: "
            f"{error}).{consequence} Check that every rank's process may read it."
        ) from error


def _checksummed_here(listed: dict[str, tuple[int, int]], share: int, shares: int
                      ) -> set[str]:
    """The files whose checksum share ``share`` of ``shares`` computes: the largest
    first, each to the share with the fewest bytes so far (the same on every rank)."""
    load = [0] * shares
    mine: set[str] = set()
    for name, (size, _) in sorted(listed.items(), key=lambda item: (-item[1][0], item[0])):
        least = load.index(min(load))
        load[least] += size
        if least == share:
            mine.add(name)
    return mine


def _verify(directory: Path, needed: dict[str, int], share: int = 0, shares: int = 1
            ) -> bool:
    _check_extents(directory, needed)
    if not (directory / MANIFEST_FILE).exists():
        ours = [name for name in (EXTRA_FILE, LAYOUT_FILE) if (directory / name).exists()]
        if ours:  # overlapkit wrote it: the list was deleted, not never there
            raise _Damaged(MANIFEST_FILE, f"is missing, where overlapkit's {', '.join(ours)} "
                           "are there, so the others cannot be verified")
        return False
    listed = _read_manifest(directory)
    for name in sorted(set(needed) - set(listed)):
        raise _Damaged(name, f"is not in its file list ({MANIFEST_FILE}), so it "
                       "cannot be verified (the list was replaced or damaged)")
    checksummed = _checksummed_here(listed, share, shares)
    for name, (size, crc) in sorted(listed.items()):
        file = directory / name
        if not file.is_file():
            problem = "is missing"
        elif (actual := file.stat().st_size) != size:
            problem = f"has {actual} bytes where {size} were saved (truncated or appended to)"
        elif name in checksummed and _crc32(file) != crc:
            problem = "has the size it was saved with but other contents (damaged or altered)"
        else:
            continue
        raise _Damaged(name, problem)
    return True
