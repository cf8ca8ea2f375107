"""The model and optimizer state dicts that ``save`` writes and ``load`` fills.

Both go through DCP's ``get_state_dict`` / ``set_state_dict``, which handle DDP, FSDP1,
FSDP2, 2-D FSDP + TP and plain modules (measured in torch 2.13: they reshard all of
these exactly across world sizes 1, 2 and 4), and any ``torch.optim.Optimizer`` whose
``state_dict()`` has the plain format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from overlapkit.errors import CheckpointError

__all__ = ["MODEL_KEY", "OPTIMIZER_KEY", "converted_dcp_errors", "state_dicts",
           "load_into"]

#: the top-level keys of a checkpoint written by :func:`overlapkit.checkpoint.save`
MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"

T = TypeVar("T")


def state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                ) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` as DCP's ``get_state_dict`` builds them.

    An optimizer that has no state yet gets it from ``get_state_dict`` (one step with
    zero gradients and a learning rate of 0). torch skips that step when any parameter
    has a gradient, and then loads no optimizer state at all; the gradients are put
    aside for the step and restored after, so that never happens here.
    """
    if optimizer is None:
        return {MODEL_KEY: get_model_state_dict(model)}
    with _gradients_aside(optimizer):
        model_sd, optim_sd = get_state_dict(model, optimizer)
    return {MODEL_KEY: model_sd, OPTIMIZER_KEY: optim_sd}


@contextmanager
def _gradients_aside(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    if optimizer.state:
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad


def load_into(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
              state: dict[str, Any]) -> None:
    """Put the loaded ``state`` back into the model and optimizer."""
    if optimizer is None:
        set_model_state_dict(model, state[MODEL_KEY])
    else:
        set_state_dict(model, optimizer, model_state_dict=state[MODEL_KEY],
                       optim_state_dict=state[OPTIMIZER_KEY])


def converted_dcp_errors(what: str, path: object, call: Callable[[], T]) -> T:
    """Run ``call``; a DCP ``CheckpointException`` becomes a :class:`CheckpointError`.

    ``CheckpointException`` derives from ``BaseException`` (torch 2.13), so ordinary
    ``except Exception`` handlers, and pytest's, let it through.
    """
    try:
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
