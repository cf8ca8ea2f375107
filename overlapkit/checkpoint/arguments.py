"""The argument checks of ``save``, ``load`` and ``inspect``: a wrong argument is a
:class:`~overlapkit.errors.CheckpointError` naming it and saying what to pass, raised on
every rank alike before any file or tensor is touched — never a raw ``AttributeError``
or ``KeyError`` from inside DCP."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from overlapkit.errors import CheckpointError
from overlapkit.optimizer_wrapper import OptimizerWrapper

__all__ = ["check_load_planner", "check_model_and_optimizer", "check_path"]


#: how each call is made, for messages
_SIGNATURES = {"save": "path, model, optimizer", "load": "path, model, optimizer",
               "inspect": "path", "latest": "path"}


def check_path(path: Any, call: str) -> Path:
    """``path`` as a ``Path``. :raises CheckpointError: it is not a str or PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(
            f"{call}: path must be a str or os.PathLike (the checkpoint directory), got "
            f"{type(path).__name__}; call {call}({_SIGNATURES.get(call, 'path, ...')})."
        )
    return Path(path)


def check_model_and_optimizer(model: Any, optimizer: Any, call: str) -> None:
    """:raises CheckpointError: ``model`` is not a module, ``optimizer`` is not an
    optimizer instance (or None), a wrapper the checkpoint cannot hold exactly
    (:meth:`~overlapkit.OptimizerWrapper.checkpoint_refusal`), or it holds parameters
    that are not ``model``'s."""
    if not isinstance(model, torch.nn.Module):
        hint = (" (an optimizer was passed as the model: the order is path, model, "
                "optimizer)" if isinstance(model, torch.optim.Optimizer) else "")
        raise CheckpointError(
            f"{call}: model must be a torch.nn.Module (the plain, DDP or FSDP model), "
            f"got {type(model).__name__}{hint}; call {call}(path, model, optimizer)."
        )
    _check_model_group(model, call)
    if optimizer is None:
        return
    if isinstance(optimizer, type):
        raise CheckpointError(
            f"{call}: optimizer must be an optimizer instance, got the class "
            f"{optimizer.__qualname__}; pass the optimizer you step (or None)."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(
            f"{call}: optimizer must be a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; pass the optimizer you step (or None)."
        )
    level: Any = optimizer
    while isinstance(level, OptimizerWrapper):
        refusal = level.checkpoint_refusal(loading=call == "load")
        if refusal is not None:
            raise CheckpointError(f"{call}: {refusal} Nothing was written or changed.")
        left_out = getattr(level, "left_out_of_checkpoints", None)  # overlap_ddp's
        if call == "save" and callable(left_out) and (warning := left_out()):
            warnings.warn(warning, UserWarning, stacklevel=4)
        level = level.wrapped
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise CheckpointError(
                    f"{call}: the optimizer holds a parameter of shape "
                    f"{tuple(param.shape)} that is not a parameter of the model; pass "
                    "the model whose parameters the optimizer steps."
                )


def _check_model_group(model: torch.nn.Module, call: str) -> None:
    """A DDP model on a subgroup the loop destroyed (``dist.destroy_process_group``)
    trains on (DDP holds the group itself), but the checkpoint's broadcast of the
    buffers and its settings check find the group's ranks in torch's registry: up to
    0.4.0 (``cdd1705``) torch's bare ``ValueError`` "Group ... is not registered" from
    inside the save or load. A group of one rank looks nothing up. The same condition as
    ``overlap.sharded.model_group.ddp_group_destroyed``, written here again on purpose:
    storage imports no technique (``tests/test_optimizer_wrapper.py``).

    :raises CheckpointError: the model's group is no longer registered."""
    group = getattr(model, "process_group", None)
    if (not isinstance(model, DistributedDataParallel) or group is None
            or not dist.is_initialized()
            or group in dist.distributed_c10d._world.pg_map or group.size() == 1):
        return
    raise CheckpointError(
        f"{call}: the DDP model's process group was destroyed "
        "(dist.destroy_process_group(group)) while the model still uses it: DDP trains on "
        "without it being registered, but the checkpoint finds the group's ranks through "
        "torch's registry, which no longer holds it. Nothing was written or changed. "
        f"Call {call}() before destroying the group, or wrap the module in a new DDP "
        "model on a live group (and its optimizer over that model's parameters)."
    )


def check_load_planner(planner: Any, call: str) -> None:
    """:raises CheckpointError: ``planner`` is neither ``None``, a name, nor a DCP
    ``LoadPlanner`` instance (a registered name that is unknown is left to the
    registry, which lists the valid ones)."""
    from torch.distributed.checkpoint.planner import LoadPlanner

    if planner is None or isinstance(planner, (str, LoadPlanner)):
        return
    if isinstance(planner, type) and issubclass(planner, LoadPlanner):
        got = f"the class {planner.__qualname__} (pass an instance: {planner.__name__}())"
    elif isinstance(planner, type):
        got = f"the class {planner.__qualname__}"
    else:
        got = type(planner).__name__
    raise CheckpointError(
        f"{call}: planner must be None, the name of a registered load planner "
        f"('default', 'offset_2d', or a plugin's) or a torch.distributed.checkpoint "
        f"LoadPlanner instance, got {got}; leave it out to choose one from the model."
    )
