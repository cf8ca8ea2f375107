"""The param groups a loaded optimizer state dict must match, checked before torch's
load raises its bare error: what every technique's ``load_state_dict`` (sharded or
not) asks first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from overlapkit.errors import ConfigurationError

__all__ = ["sizes_refusal"]


def sizes_refusal(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any],
                  model: torch.nn.Module | None = None,
                  technique: str = "overlap_ddp") -> ConfigurationError | None:
    """The refusal of a whole ``state_dict`` whose param groups do not hold as many
    parameters as ``optimizer``'s, else None; naming the frozen parameters of ``model``
    the optimizer leaves out when they make the difference.

    torch's load raises a bare ``ValueError`` ("loaded state dict contains a parameter
    group that doesn't match the size of optimizer's group") there, on every rank. The
    usual cause is overlapkit's own: a technique without ``params=`` holds the
    trainable parameters (``overlap_ddp``: those DDP reduces), so a frozen one
    (``requires_grad=False``) is left out,
    where a plain ``AdamW(model.parameters())`` holds it (measured: the plain loop's
    dict, 5 parameters in its group where the optimizer holds 3, a frozen layer's 2
    left out, refused with torch's error on both of 2 gloo ranks, nothing saying
    why; the same with ``overlap_ddp`` and ``optimizer_in_backward`` unsharded)."""
    saved = [len(group.get("params", ())) for group in state_dict.get("param_groups", ())
             if isinstance(group, Mapping)]
    mine = [len(group["params"]) for group in optimizer.param_groups]
    if saved == mine:
        return None
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    model = getattr(model, "module", model)  # a DDP model's names, without "module."
    frozen = [] if model is None else [name for name, p in model.named_parameters()
                                       if not p.requires_grad and id(p) not in held]
    why = (f" The model's frozen parameters {frozen} (requires_grad=False) are not in this "
           f"optimizer: without params=, {technique} holds the trainable parameters, "
           "where a plain optimizer built on model.parameters() holds the frozen ones "
           "too. Pass params=model.parameters() (or the plain optimizer's param "
           "groups) to hold them as it does.") if frozen and sum(saved) == sum(mine) + len(
        frozen) else " Load a state dict saved for these parameters and param groups."
    return ConfigurationError(
        f"this state dict's param groups hold {saved} parameters and this optimizer's "
        f"{mine}, so its state cannot be matched to the parameters. Nothing was "
        f"loaded.{why}")
