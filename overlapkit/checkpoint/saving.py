"""Atomic checkpoint saves.

Every rank writes its part into a sibling directory ``.NAME.saving``; once DCP has
written the metadata (its last step), rank 0 moves an existing checkpoint at the path
aside to ``.NAME.old``, renames ``.NAME.saving`` to the path, and deletes the old one;
a barrier then lets every rank return. A save killed at any point leaves the previous
checkpoint loadable: before the swap it is untouched at the path (the partial
``.NAME.saving`` is removed by the next save); during the two renames it is intact at
``.NAME.old``, which the next save moves back and ``load`` points to.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from overlapkit.checkpoint._state import converted_dcp_errors, state_dicts
from overlapkit.checkpoint.metadata import METADATA_FILE
from overlapkit.errors import CheckpointError

__all__ = ["save"]


def _siblings(path: Path) -> tuple[Path, Path]:
    return path.parent / f".{path.name}.saving", path.parent / f".{path.name}.old"


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _check_destination(path: Path) -> None:
    # Every rank checks, so every rank raises alike before the first collective.
    if path.is_file() or (path.is_dir() and any(path.iterdir())
                          and not (path / METADATA_FILE).is_file()):
        raise CheckpointError(
            f"{path} exists and is not a checkpoint; overlapkit.checkpoint.save replaces "
            "only a previous checkpoint. Choose another path, or remove it first."
        )


def _recover_and_clean(path: Path, saving: Path, old: Path) -> None:
    if (old / METADATA_FILE).is_file() and not path.exists():
        os.replace(old, path)  # a previous save died between its two renames
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(saving, ignore_errors=True)  # left by a save that was killed


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_into_place(path: Path, saving: Path, old: Path) -> None:
    had_previous = path.exists()
    if had_previous:
        os.replace(path, old)
    os.replace(saving, path)
    _fsync_dir(path.parent)
    if had_previous:
        shutil.rmtree(old, ignore_errors=True)


def save(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
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
    save leaves the previous checkpoint at ``path`` intact.

    :return: ``path`` as a ``Path``.
    :raises CheckpointError: ``path`` exists and is not a checkpoint, or writing failed.
    """
    path = Path(path)
    saving, old = _siblings(path)
    _check_destination(path)
    if _is_rank_zero():
        path.parent.mkdir(parents=True, exist_ok=True)
        _recover_and_clean(path, saving, old)
    state = state_dicts(model, optimizer)
    _barrier()
    writer = dcp.FileSystemWriter(saving, sync_files=True)
    converted_dcp_errors("saving the checkpoint to", path,
                         lambda: dcp.save(state, storage_writer=writer))
    # dcp.save returns on every rank only after rank 0 wrote the metadata.
    if _is_rank_zero():
        _swap_into_place(path, saving, old)
    _barrier()
    return path
