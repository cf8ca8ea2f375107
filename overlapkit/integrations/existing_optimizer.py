"""Step an optimizer a framework already built during backward, keeping the instance.

Trainer frameworks build the optimizer themselves (the ``Trainer``'s
``create_optimizer``: its class from ``args.optim``, decay and no-decay groups), or get
it from the user, hand it to an LR scheduler, and load a checkpoint into it. The
integrations keep that very instance as the real optimizer that
:func:`overlapkit.overlap_ddp` / :func:`overlapkit.optimizer_in_backward` step: its
``param_groups`` (the scheduler's), its ``state`` (the checkpoint's) and its class (its
registered engine) stay what the framework set up, so the run is the plain run with the
steps moved into backward.

:func:`overlap_existing` is a thin call into the public adopt path: the techniques
take the instance itself (:mod:`overlapkit.overlap.adopt`), and their checks run on
that instance's groups.
"""

from __future__ import annotations

from typing import Any

import torch

import overlapkit
from overlapkit.errors import ConfigurationError, UnsupportedOptimizerError
from overlapkit.optimizer_wrapper import OptimizerWrapper
from overlapkit.overlap.adopt import check_adopted
from overlapkit.overlap.facade import OverlappedOptimizerFacade

__all__ = ["TECHNIQUES", "check_technique", "overlap_existing"]

#: what an integration's ``technique=`` may be
TECHNIQUES = ("overlap_ddp", "optimizer_in_backward")


def check_technique(technique: Any) -> str:
    """:raises ConfigurationError: ``technique`` is not one of :data:`TECHNIQUES`."""
    if technique not in TECHNIQUES:
        raise ConfigurationError(
            f"technique must be one of {', '.join(map(repr, TECHNIQUES))}, got "
            f"{technique!r}: 'overlap_ddp' steps each DDP gradient bucket as its allreduce "
            "completes (2 or more processes), 'optimizer_in_backward' steps each part of "
            "the model during backward and frees its gradient."
        )
    return str(technique)


def overlap_existing(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     technique: str, **options: Any) -> OverlappedOptimizerFacade:
    """``overlapkit.<technique>(model, ...)`` taking its steps with ``optimizer``.

    :param model: the model as the framework trains it (DDP on several processes).
    :param optimizer: a plain ``torch.optim`` optimizer over ``model``'s parameters,
        possibly with state (a checkpoint loaded into it).
    :param options: the technique's keyword options (``clip_grad_norm``, ...).
    :raises UnsupportedOptimizerError: ``optimizer`` is already overlapped or wrapped
        (post-local SGD, ...), or not an optimizer.
    :raises OverlapkitError: whatever the technique refuses (see its documentation).
    """
    technique = check_technique(technique)
    if isinstance(optimizer, OptimizerWrapper):
        raise UnsupportedOptimizerError(
            f"the optimizer is already an overlapkit {type(optimizer).__name__}; give the "
            "integration the plain optimizer (e.g. torch.optim.AdamW(model.parameters())) "
            "and it sets up the technique itself, after the framework has wrapped the "
            "model."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"expected a torch.optim.Optimizer instance, got {type(optimizer).__name__}."
        )
    build = getattr(overlapkit, technique)
    facade: OverlappedOptimizerFacade = build(model, optimizer, **options)
    check_adopted(facade.optimizer, optimizer)
    return facade
