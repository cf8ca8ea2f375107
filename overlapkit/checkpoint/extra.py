"""The caller's own progress, saved inside the checkpoint: ``save(..., extra={...})``.

A training loop resumes from more than the model and optimizer: the step, an LR
scheduler's ``state_dict()``, a data loader's position. Kept in a file of its own beside
the checkpoint, it is written at another moment: a run killed between the two writes
resumes with the model of one step and the schedule of another, without an error. So
``extra`` is written into the checkpoint directory before it is moved into place,
listed in its file manifest (size and checksum), and loaded with it: the two are
complete together or not at all.

It is stored as JSON — plain data only (dicts with string keys, lists, strings,
numbers, booleans, ``None``) — so loading it runs no code from the file, and every
value comes back exactly (Python floats round-trip through JSON, ``inf`` and ``nan``
included). Anything else is refused at save with a
:class:`~overlapkit.errors.CheckpointError` naming where it is, before anything is
written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from overlapkit.errors import CheckpointError

__all__ = ["EXTRA_FILE", "check_extra", "read_extra", "write_extra"]

#: the file holding ``extra`` inside a checkpoint directory
EXTRA_FILE = ".overlapkit-extra.json"

_SCALARS = (str, int, float, bool, type(None))


def _check(value: Any, where: str) -> None:
    if isinstance(value, _SCALARS):
        return
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check(item, f"{where}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(
                    f"extra{where} has the key {key!r} ({type(key).__name__}); extra is "
                    "saved as JSON, whose keys are strings: use str keys (and convert "
                    "back after load)."
                )
            _check(item, f"{where}[{key!r}]")
        return
    raise CheckpointError(
        f"extra{where} is a {type(value).__name__}; extra is saved as JSON: pass plain "
        "data (dicts with str keys, lists, str, int, float, bool, None), e.g. "
        "{'step': 100, 'scheduler': scheduler.state_dict()}. Tensors belong in the model "
        "or optimizer; a tuple, as a list."
    )


def check_extra(extra: object) -> dict[str, Any]:
    """``extra`` as a dict, checked to be plain JSON data (before anything is written).

    :raises CheckpointError: not a dict, or holding a value JSON would not give back as
        it is (naming where).
    """
    if not isinstance(extra, Mapping):
        raise CheckpointError(
            f"extra must be a dict of plain data, got {type(extra).__name__}; pass e.g. "
            "extra={'step': step, 'scheduler': scheduler.state_dict()}."
        )
    extra = dict(extra)
    _check(extra, "")
    return extra


def write_extra(directory: Path, extra: dict[str, Any]) -> None:
    """Write ``extra`` into the checkpoint being saved (rank 0, before the manifest)."""
    (directory / EXTRA_FILE).write_text(json.dumps(extra, allow_nan=True))


def read_extra(directory: Path) -> dict[str, Any]:
    """The ``extra`` saved with the checkpoint at ``directory``; ``{}`` when none was.

    Call it after the files were verified against the manifest.

    :raises CheckpointError: the file is not valid JSON of a dict.
    """
    file = directory / EXTRA_FILE
    if not file.is_file():
        return {}
    try:
        extra = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"the checkpoint at {directory} has a damaged {EXTRA_FILE} ({type(error).__name__}: "
            f"{error}); load an earlier checkpoint."
        ) from error
    if not isinstance(extra, dict):
        raise CheckpointError(
            f"the checkpoint at {directory} has a {EXTRA_FILE} that holds no dict; load "
            "an earlier checkpoint."
        )
    return extra
