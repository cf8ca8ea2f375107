"""Checking a state dict against a checkpoint's metadata before anything is read.

DCP reports a missing key or a shape mismatch from deep inside its planner, after a
collective, as a ``CheckpointException`` (a ``BaseException``) wrapping each rank's
traceback. Comparing the flattened state dict with the metadata first gives one
:class:`~overlapkit.errors.CheckpointError` that names what differs and what to do, on
every rank alike (every rank reads the same metadata and builds the same keys).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from overlapkit.errors import CheckpointError

__all__ = ["check_against_metadata", "check_param_groups"]

_SHOWN = 5


def _few(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _under(keys: Iterable[str], prefix: str) -> set[str]:
    return {k for k in keys if k == prefix or k.startswith(prefix + ".")}


def check_against_metadata(
    flat_state_dict: Mapping[str, Any],
    metadata: Metadata,
    *,
    path: object,
    model_key: str = "model",
    optimizer_key: str | None = "optimizer",
    others: Iterable[str] = (),
) -> None:
    """Raise a :class:`CheckpointError` unless every entry of ``flat_state_dict`` (a DCP
    flattened state dict) is in the checkpoint with the same global shape, and the
    checkpoint holds nothing else under ``model_key`` and ``optimizer_key`` (but under
    the prefixes ``others``: the optimizer state of the parameters other ranks own when
    it is sharded, which those ranks check).

    Checked in this order, so the most telling error wins: model keys (a checkpoint
    of a different model), the optimizer key itself, optimizer keys (a different
    optimizer or settings), then shapes.
    """
    saved = metadata.state_dict_metadata
    wanted = set(flat_state_dict)
    elsewhere: set[str] = set()
    for prefix in others:
        elsewhere |= _under(saved, prefix)
    sections = [model_key] + ([optimizer_key] if optimizer_key else [])
    for section in sections:
        mine, theirs = _under(wanted, section), _under(saved, section) - elsewhere
        if mine and not theirs:
            tops = sorted({str(k).split(".", 1)[0] for k in saved})
            raise CheckpointError(
                f"the checkpoint at {path} has no {section!r} entries (its top-level keys "
                f"are {tops}). It was not written by overlapkit.checkpoint.save with "
                f"{'a model' if section == model_key else 'an optimizer'}; load it with "
                "the API that wrote it, or pass the matching key."
            )
        missing, unexpected = mine - theirs, theirs - mine
        if not (missing or unexpected):
            continue
        if section == model_key:
            what = "a different model"
            todo = ("Build the same model (same modules and parameter names) before "
                    "loading, or load the checkpoint that belongs to this model.")
        else:
            what = "a different optimizer or optimizer settings"
            todo = ("Create the same optimizer class with the same parameter groups as "
                    "when the checkpoint was saved, then load.")
        detail = []
        if missing:
            detail.append(f"missing from the checkpoint: {_few(missing)}")
        if unexpected:
            detail.append(f"in the checkpoint but not expected: {_few(unexpected)}")
        raise CheckpointError(
            f"the checkpoint at {path} is from {what}: {'; '.join(detail)}. {todo}"
        )
    for key in sorted(wanted):
        value, stored = flat_state_dict[key], saved.get(key)
        if stored is None:
            raise CheckpointError(
                f"the checkpoint at {path} has no entry {key!r}; save it with this "
                "model and optimizer, or load the checkpoint that belongs to them."
            )
        if isinstance(value, torch.Tensor):
            if isinstance(stored, BytesStorageMetadata):
                raise CheckpointError(
                    f"{key!r} is a tensor here but a non-tensor value in the checkpoint at "
                    f"{path}; load it into the model and optimizer that saved it."
                )
            assert isinstance(stored, TensorStorageMetadata)
            if tuple(value.size()) != tuple(stored.size):
                raise CheckpointError(
                    f"{key!r} has shape {tuple(stored.size)} in the checkpoint at {path} "
                    f"but {tuple(value.size())} here; build the model with the same "
                    "sizes as when it was saved (resharding changes the local shards, "
                    "never the global shape)."
                )
        elif isinstance(stored, TensorStorageMetadata):
            raise CheckpointError(
                f"{key!r} is a tensor of shape {tuple(stored.size)} in the checkpoint at "
                f"{path} but a {type(value).__name__} here; load it into the model and "
                "optimizer that saved it."
            )


def check_param_groups(
    saved_values: Mapping[str, Any],
    metadata: Metadata,
    live_groups: list[dict[str, Any]],
    defaults: Mapping[str, Any],
    *,
    path: object,
    optimizer_key: str = "optimizer",
) -> None:
    """Raise a :class:`CheckpointError` unless each saved param group holds the same
    parameters as the live group at its position and every hyperparameter the live
    optimizer's class defines.

    DCP maps saved optimizer state to parameters by name and group settings by group,
    so a checkpoint whose groups split the parameters differently loads without an
    error and leaves a group without its settings (measured in torch 2.13: ``lr`` and
    ``betas`` gone, a ``KeyError`` at the next step); a checkpoint of another optimizer
    class (or one saved before any state existed) would bring another class's settings
    (``momentum`` for SGD where Adam needs ``betas``).

    :param saved_values: the checkpoint's non-tensor entries, flattened
        (``optimizer.param_groups.0.params`` -> the parameter names of group 0).
    :param live_groups: the ``param_groups`` of the state dict being loaded into
        (parameter names in ``params``).
    :param defaults: the live optimizer's ``defaults``: every group has these keys.
    """
    prefix = f"{optimizer_key}.param_groups."
    saved_keys: dict[int, set[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(prefix):
            position, _, name = key[len(prefix):].partition(".")
            if position.isdigit() and name and "." not in name:
                saved_keys.setdefault(int(position), set()).add(name)
    todo = ("Create the optimizer with the same class and the same parameter groups as "
            "the run that saved it, then load.")
    for index, group in enumerate(live_groups):
        names = saved_keys.get(index, set())
        lacking = sorted(set(defaults) - names)
        if names and lacking:
            raise CheckpointError(
                f"the checkpoint at {path} is from a different optimizer class: its param "
                f"group {index} has no {_few(lacking)}, which this optimizer needs. {todo}"
            )
        saved = saved_values.get(f"{prefix}{index}.params")
        if not isinstance(saved, (list, tuple)):
            continue
        mine, theirs = {str(n) for n in group.get("params", ())}, {str(n) for n in saved}
        if mine != theirs:
            detail = []
            if theirs - mine:
                detail.append(f"only the checkpoint's has {_few(theirs - mine)}")
            if mine - theirs:
                detail.append(f"only this optimizer's has {_few(mine - theirs)}")
            raise CheckpointError(
                f"the checkpoint at {path} groups the parameters differently: of param "
                f"group {index}, {'; '.join(detail)}. {todo}"
            )
