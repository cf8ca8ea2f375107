"""The directories a save goes through, and which of them holds the newest complete
checkpoint after a save was killed at any instant.

A save to ``NAME`` writes ``.NAME.saving``; rank 0 then writes the file list
(``.overlapkit-files.json``, atomically, last: it marks the checkpoint complete), moves
``NAME`` aside to ``.NAME.old``, ``.NAME.saving`` to ``NAME``, and deletes
``.NAME.old``. Killed in between, the directory holds one of these states (the newest
complete checkpoint in bold):

=========================================  ===========  ========  ===========
instant of the kill                        ``.saving``  ``NAME``  ``.old``
=========================================  ===========  ========  ===========
while the ranks write, or before the list  partial      **prev**  none
after the list, before the first rename    **new**      prev      none
between the two renames                    **new**      none      prev
after the second rename, while deleting    none         **new**   prev (part)
=========================================  ===========  ========  ===========

So the newest complete checkpoint is ``.NAME.saving`` when it has its file list and
every listed file, else ``NAME``, else ``.NAME.old`` (:func:`newest_complete`), and
the next save — or :func:`~overlapkit.checkpoint.latest` — first finishes the
interrupted one (:func:`finish_interrupted_save`), so a complete checkpoint is never
thrown away for an older one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from overlapkit.checkpoint.integrity import MANIFEST_FILE
from overlapkit.checkpoint.metadata import METADATA_FILE
from overlapkit.errors import CheckpointError
from overlapkit.nodes.exit_safe import broadcast_text

__all__ = [
    "damage",
    "finish_interrupted_save",
    "fingerprint",
    "newest_complete",
    "on_rank_zero",
    "remove",
    "siblings",
    "swap_into_place",
]

#: overlapkit's own files in a checkpoint start so (file list, extra, DDP layout)
_OURS = ".overlapkit-"


def siblings(path: Path) -> tuple[Path, Path]:
    """``.NAME.saving`` and ``.NAME.old`` beside ``path``."""
    return path.parent / f".{path.name}.saving", path.parent / f".{path.name}.old"


def remove(path: Path) -> None:
    """Remove what is at ``path``: a directory tree, a file or a link (not its target)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def damage(directory: Path, *, need_list: bool = False) -> str | None:
    """What keeps ``directory`` from being a complete checkpoint, or ``None``.

    Complete: a directory with DCP's ``.metadata`` and overlapkit's file list, every
    listed file there with its listed size (checksums are :func:`load`'s to verify).
    Without a file list it is complete only when none of overlapkit's files is there
    (a checkpoint of torch's DCP or of an overlapkit before the list) and
    ``need_list`` is false: a save's ``.NAME.saving`` without its list is unfinished.
    """
    if not directory.is_dir():
        return "is not a directory"
    if not (directory / METADATA_FILE).is_file():
        return f"has no {METADATA_FILE} file (DCP's, written last by the ranks)"
    manifest = directory / MANIFEST_FILE
    if not manifest.is_file():
        ours = sorted(f.name for f in directory.iterdir() if f.name.startswith(_OURS))
        if ours:
            return (f"has overlapkit's {', '.join(ours)} but not its file list "
                    f"{MANIFEST_FILE}: the list is missing")
        return "has no file list: the save did not finish" if need_list else None
    try:
        files = json.loads(manifest.read_text())["files"]
        listed = {str(name): int(entry["size"]) for name, entry in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"has a damaged file list {MANIFEST_FILE} ({type(error).__name__}: {error})"
    for name, size in sorted(listed.items()):
        file = directory / name
        if not file.is_file():
            return f"lacks its file {name}, which its file list names"
        if file.stat().st_size != size:
            return f"has its file {name} at {file.stat().st_size} bytes where {size} were saved"
    return None


def _complete_sibling(sibling: Path, *, need_list: bool = False) -> bool:
    """Whether ``.NAME.saving`` or ``.NAME.old`` holds a complete checkpoint (a link
    there is a left-over to remove, never a checkpoint to move: a save writes neither
    as a link)."""
    return not sibling.is_symlink() and damage(sibling, need_list=need_list) is None


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def newest_complete(path: Path) -> Path | None:
    """The newest complete checkpoint a save to ``path`` left, whatever instant it was
    killed at (see the module's table): ``.NAME.saving``, ``path`` or ``.NAME.old``;
    ``None`` when there is none (nothing there yet, or an empty directory).

    :raises CheckpointError: ``path`` (or, with nothing at ``path``, ``.NAME.old``) is
        there but damaged — never answered with an older checkpoint or none, which
        would resume the run from further back without a word; or ``path`` is not a
        checkpoint at all.
    """
    saving, old = siblings(path)
    if _complete_sibling(saving, need_list=True):
        return saving
    if (path.exists() or path.is_symlink()) and not _empty_dir(path):
        if path.is_file() or (path.is_dir() and not (path / METADATA_FILE).is_file()
                              and not any(f.name.startswith(_OURS) for f in path.iterdir())):
            raise CheckpointError(
                f"{path} exists and is not a checkpoint (a file, or a directory without "
                f"{METADATA_FILE}); point at the checkpoint directory, or remove it.")
        problem = damage(path)
        if problem is not None:
            raise CheckpointError(
                f"the checkpoint at {path} is damaged: it {problem}. Resuming from an older "
                "checkpoint, or from the start, would go back without a word: restore the "
                f"missing file, or remove {path} to start afresh.")
        return path
    if old.exists() and not old.is_symlink():
        problem = damage(old)
        if problem is None:
            return old
        raise CheckpointError(
            f"nothing is at {path}, and the previous checkpoint a save left at {old} is "
            f"damaged: it {problem}. Remove {old} to start afresh.")
    return None


def fingerprint(directory: Path) -> str:
    """A digest that tells two checkpoints apart: of the file list (it holds every
    file's checksum), else of DCP's ``.metadata`` (it holds the save's own id)."""
    manifest = directory / MANIFEST_FILE
    source = manifest if manifest.is_file() else directory / METADATA_FILE
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


def swap_into_place(path: Path, saving: Path, old: Path) -> None:
    """Move the new checkpoint to ``path``, the previous one aside; if the second
    rename fails, the previous checkpoint is moved back to ``path``."""
    had_previous = path.exists() or path.is_symlink()
    if had_previous:
        remove(old)  # a leftover of an earlier interrupted save: older than path
        os.replace(path, old)
    try:
        os.replace(saving, path)
    except BaseException:
        if had_previous and not path.exists():
            os.replace(old, path)  # the previous checkpoint stays where it was
        raise
    _fsync_dir(path.parent)
    remove(old)


def finish_interrupted_save(path: Path) -> None:
    """Finish what a killed save to ``path`` left (rank 0; at the start of a save, and
    in :func:`~overlapkit.checkpoint.latest`): a complete ``.NAME.saving`` is moved to
    ``path``, else ``.NAME.old`` back to an empty ``path``; then the leftovers go."""
    saving, old = siblings(path)
    if _empty_dir(path):
        path.rmdir()  # nothing there: the newest complete checkpoint takes its place
    if _complete_sibling(saving, need_list=True):
        swap_into_place(path, saving, old)
    elif not (path.exists() or path.is_symlink()) and _complete_sibling(old):
        os.replace(old, path)
        _fsync_dir(path.parent)
    remove(old)
    remove(saving)


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def on_rank_zero(what: str, path: Path, action: Callable[[], None], *,
                 call: str = "saving the checkpoint to") -> None:
    """Run ``action`` on rank 0 only; if it fails, raise a ``CheckpointError`` on every
    rank (the outcome is broadcast, which also makes every rank wait for rank 0)."""
    error: str | None = None
    cause: Exception | None = None
    if _is_rank_zero():
        try:
            action()
        except Exception as exc:
            error, cause = f"{type(exc).__name__}: {exc}", exc
    if dist.is_initialized() and dist.get_world_size() > 1:
        # the last collective of a save, which may be the program's last: its tensors
        # must go on this thread (overlapkit.nodes.exit_safe)
        error = broadcast_text(error, src=0)
    if error is not None:
        raise CheckpointError(
            f"{call} {path} failed on rank 0 while {what}: {error}. "
            "Check that the directory is writable and that nothing else uses the "
            f"names {path.name}, .{path.name}.saving and .{path.name}.old there."
        ) from cause
