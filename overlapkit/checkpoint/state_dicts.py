"""The DCP glue: the state dicts that ``save`` writes and ``load`` fills, and DCP's
errors as :class:`~overlapkit.errors.CheckpointError`.

Both directions go through DCP's ``get_state_dict`` / ``set_state_dict``, which handle
DDP, FSDP1, FSDP2, 2-D FSDP + TP and plain modules (measured in torch 2.13: they reshard
all of these exactly across world sizes 1, 2 and 4), and any ``torch.optim.Optimizer``
whose ``state_dict()`` has the plain format. They work on the real optimizer behind any
:class:`~overlapkit.OptimizerWrapper` (:func:`~overlapkit.optimizer_wrapper.unwrapped`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from overlapkit.checkpoint.optimizer_state import init_optimizer_state
from overlapkit.errors import CheckpointError

__all__ = ["MODEL_KEY", "OPTIMIZER_KEY", "converted_dcp_errors", "load_into", "share_fqns",
           "state_dicts"]

#: the top-level keys of a checkpoint written by :func:`overlapkit.checkpoint.save`
MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"

T = TypeVar("T")


def state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                only: set[int] | None = None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` as DCP's ``get_state_dict`` builds them.

    An optimizer that has no state yet (loading into a fresh one) gets it first, see
    :func:`init_optimizer_state`.

    :param only: ``id`` of the parameters whose optimizer state this rank keeps
        (sharded optimizer state): the optimizer state dict holds theirs only. DCP's
        ``get_state_dict`` gives an optimizer with no state at all some for every
        parameter first (a step with zero gradients): on a rank whose share has none,
        that state is left out here, and removed by the caller.
    """
    if optimizer is None:
        return {MODEL_KEY: get_model_state_dict(model)}
    init_optimizer_state(optimizer, only=only)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if only is not None:
        keep = share_fqns(model, only)
        saved: Any = optim_sd["state"]
        optim_sd["state"] = {fqn: value for fqn, value in saved.items() if fqn in keep}
    return {MODEL_KEY: model_sd, OPTIMIZER_KEY: optim_sd}


def share_fqns(model: torch.nn.Module, ids: set[int]) -> set[str]:
    """The names DCP's state dicts give the parameters whose ``id`` is in ``ids`` (DCP's
    own ``_get_fqns``, which drops the wrappers' prefixes: DDP's ``module.``)."""
    names: set[str] = set()
    for name, param in model.named_parameters():
        if id(param) in ids:
            names |= set(_get_fqns(model, name))
    return names


def load_into(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
              state: dict[str, Any], *, partial_optimizer_state: bool = False) -> None:
    """Put the loaded ``state`` back into the model and optimizer.

    :param partial_optimizer_state: some parameters have no optimizer state (they had
        none when saved); DCP's strict check would refuse that. Everything else was
        checked against the checkpoint's metadata before, so nothing else is let
        through by not being strict.
    """
    if optimizer is None:
        set_model_state_dict(model, state[MODEL_KEY])
    else:
        options = StateDictOptions(strict=not partial_optimizer_state)
        set_state_dict(model, optimizer, model_state_dict=state[MODEL_KEY],
                       optim_state_dict=state[OPTIMIZER_KEY], options=options)


def converted_dcp_errors(what: str, path: object, call: Callable[[], T]) -> T:
    """Run ``call``; a DCP ``CheckpointException`` becomes a :class:`CheckpointError`.

    ``CheckpointException`` derives from ``BaseException`` (torch 2.13), so ordinary
    ``except Exception`` handlers, and pytest's, let it through.
    """
    try:
        with warnings.catch_warnings():
            # DCP warns on every single-process save and load that it assumes a single
            # process; that is what overlapkit's save and load document.
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled, unavailable or "
                "uninitialized", category=UserWarning)
            return call()
    except CheckpointException as exc:
        failures = getattr(exc, "failures", {}) or {}
        first = ""
        if failures:
            rank = min(failures)
            error = failures[rank]
            if isinstance(error, tuple):  # (exception, traceback summary)
                error = error[0]
            first = f" First failure, on rank {rank}: {type(error).__name__}: {error}"
        raise CheckpointError(
            f"{what} {path} failed on ranks {sorted(failures)}.{first}. Check that every "
            "rank sees the same path and has the same model and optimizer, and that the "
            "disk has room."
        ) from exc
