"""Adopt an optimizer instance the user or a framework already built.

:func:`overlapkit.overlap_ddp` and :func:`overlapkit.optimizer_in_backward` take an
optimizer *class* (built from ``params`` and the keyword arguments) or an existing
``torch.optim.Optimizer`` *instance*. An instance is kept: the overlapped optimizer
steps that very object, so references to it held by a module (``self.optimizer``), by
callbacks and by LR schedulers built on it stay live, and its param groups and state
(a loaded checkpoint) are what is trained. The techniques' checks (the parameters are
the model's, trainable, reduced by DDP, not stepped by another technique, the class can
be stepped part by part) run on its groups as for any other call.

The set-up pass (:mod:`overlapkit.overlap.resolved`) records the instance as the
optimizer to step (``ResolvedSetup.adopted``), its class (for the registered engine) and
its own ``param_groups`` (the same dicts, so a scheduler built on it drives the
overlapped steps); nothing builds another optimizer, and no class is generated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from overlapkit.errors import ConfigurationError, UnsupportedOptimizerError
from overlapkit.optimizer_wrapper import OptimizerWrapper

__all__ = ["check_adoptable", "check_adopted", "is_instance"]


def is_instance(optim: Any) -> bool:
    """``optim`` is an optimizer object (to adopt), not an optimizer class."""
    return isinstance(optim, (torch.optim.Optimizer, OptimizerWrapper))


def check_adoptable(optimizer: Any, args: Sequence[Any], optim_kwargs: Mapping[str, Any],
                    params: Any, technique: str) -> None:
    """Refuse what ``technique`` cannot do with the instance ``optimizer``.

    :raises UnsupportedOptimizerError: ``optimizer`` is already overlapped or wrapped by
        overlapkit.
    :raises ConfigurationError: optimizer arguments or ``params=`` given with an
        instance (they belong to the optimizer: set them on it), or step hooks
        registered on it.
    """
    if isinstance(optimizer, OptimizerWrapper):
        raise UnsupportedOptimizerError(
            f"the optimizer is already an overlapkit {type(optimizer).__name__}, so "
            f"{technique} would step it a second time; pass the plain optimizer it wraps "
            "(e.g. torch.optim.AdamW(model.parameters())), or its class."
        )
    name = type(optimizer).__name__
    given = [f"{k}={v!r}" for k, v in optim_kwargs.items()]
    given += [f"positional argument {a!r}" for a in args]
    if given:
        raise ConfigurationError(
            f"{technique} was given an existing {name} instance and the optimizer "
            f"arguments {', '.join(given)}, which apply only when it builds the optimizer "
            "from a class; set them on the instance before the call (e.g. "
            "optimizer.param_groups[0]['lr'] = ...), or pass the class instead."
        )
    if params is not None:
        raise ConfigurationError(
            f"{technique} was given an existing {name} instance and params=; the "
            "instance's own param groups are stepped. Build the optimizer over the "
            "parameters to step (optimizer.add_param_group for more), and leave params "
            "out."
        )
    wrapped = _wrapped_optimizer(optimizer)
    if wrapped is not None:
        attribute, inner = wrapped
        raise UnsupportedOptimizerError(
            f"the {name} wraps another optimizer ({inner}, its attribute {attribute!r}) "
            "over the same parameters and steps it from its own step() (as a Lookahead or a SAM "
            f"does): {technique} steps part by part during backward, so each part's step "
            f"would step the whole {inner}, once per part. Pass the {inner} itself "
            f"(optimizer.{attribute}) and do the {name}'s work in the loop after "
            "optimizer.step() (every parameter holds its update then), or train without "
            "overlap."
        )
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        raise ConfigurationError(
            f"the {name} has step hooks (register_step_pre_hook / "
            f"register_step_post_hook): they run around optimizer.step(), so {technique} "
            "would take every step there, in the plain order, without overlap, while they "
            "are registered; remove them and do that work after optimizer.step() in the "
            "loop (or register them after set-up to accept the plain order)."
        )


def _wrapped_optimizer(optimizer: Any) -> tuple[str, str] | None:
    """``(attribute, class name)`` of another optimizer ``optimizer`` holds over the
    same parameters (a Lookahead's base optimizer, torch's ``PostLocalSGDOptimizer``'s
    ``optim``), else None. An optimizer stepped part by part must step only the part
    asked; one stepping another steps all of that one's parameters (measured before
    this check: a timm-style Lookahead over AdamW under ``optimizer_in_backward`` was
    refused in backward as "this AdamW steps a parameter ... already stepped")."""
    own = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for attribute, value in vars(optimizer).items():
        if isinstance(value, torch.optim.Optimizer) and value is not optimizer and any(
                id(p) in own for group in value.param_groups for p in group["params"]):
            return attribute, type(value).__name__
    return None


def check_adopted(built: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> None:
    """The set-up stepped ``optimizer`` itself (an internal invariant)."""
    if built is not optimizer:
        raise AssertionError("overlapkit built another optimizer than the one given")
