"""What the ``Accelerator``'s own methods show of the window between backward and
``optimizer.step()``, for :mod:`overlapkit.integrations.accelerate` and
:mod:`overlapkit.integrations.transformers` (private to them):

- ``accelerator.save_state()`` / ``load_state()`` there (:func:`guard_checkpoints`). In
  the plain loop the step comes after them: a save keeps the parameters and optimizer
  state before it, a load gives the step its starting point. Here the backward has
  stepped already, so a save kept this step (measured: the saved model 0.0101 off the
  plain loop's checkpoint, Adam's moments 0.0056, silently) and a load loaded the model
  before the optimizer refused its own part (the parameters 0.0201 changed when the
  refusal came). Both are refused now before anything is written or loaded, as
  :func:`overlapkit.checkpoint.save` / ``load`` are there (docs/window.inc).
- whether the steps are paused now, inside ``accelerator.no_sync(model)``
  (:func:`steps_paused`): the Trainer runs a micro-batch outside it that ends no
  optimizer step at the end of an epoch shorter than its accumulation window
  (:mod:`overlapkit.integrations.transformers`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from overlapkit.errors import ConfigurationError

__all__ = ["PAUSED", "forward_past_ddp_refusal", "guard_checkpoints", "steps_paused",
           "watch_forwards_past_ddp"]

#: how an Accelerate loop's forward goes past DDP, and what to do instead
#: (:func:`forward_past_ddp_refusal`)
ACCELERATE_PAST = "accelerator.unwrap_model(model)(...) or model.module(...)"
ACCELERATE_FIX = ("Run the training forward through the model "
                  "overlapkit.integrations.accelerate.prepare returned (keep unwrap_model for "
                  "saving, and for generation under torch.no_grad()).")

#: the attribute of a DDP model set up by overlapkit holding what its forwards did since
#: the last ``accelerator.backward`` (:func:`watch_forwards_past_ddp`)
FORWARDS = "_overlapkit_forwards"

#: the attribute of an accelerator counting the ``no_sync(model)`` blocks open on it
#: whose steps overlapkit pauses (set by :mod:`overlapkit.integrations.accelerate`)
PAUSED = "_overlapkit_paused"


def steps_paused(accelerator: Any) -> bool:
    """Whether a backward now steps nothing: inside ``accelerator.no_sync(model)`` of a
    model whose steps overlapkit pauses there."""
    return bool(getattr(accelerator, PAUSED, 0))


def guard_checkpoints(accelerator: Any, facades: Callable[[], list[Any]]) -> None:
    """Make ``accelerator.save_state`` / ``load_state`` raise a ConfigurationError,
    writing or loading nothing, between a backward that stepped ``facades()``'s
    optimizers and their ``step()`` (once the loop has called ``step()`` after a
    backward; a load also in the first window, where that is not known yet:
    ``checkpoint_refusal``). Wrapped once per accelerator (an attribute of this
    instance; nothing else changes)."""
    if getattr(accelerator, "_overlapkit_checkpoints_guarded", False):
        return

    def guarded(method: Callable[..., Any], loading: bool) -> Callable[..., Any]:
        call = "load_state" if loading else "save_state"

        @functools.wraps(method)
        def refusing(*args: Any, **kwargs: Any) -> Any:
            for facade in facades():
                refusal = facade.checkpoint_refusal(loading=loading)
                if refusal is not None:
                    raise ConfigurationError(
                        f"accelerator.{call}() refused: {refusal} Nothing was "
                        f"{'loaded' if loading else 'written'}.")
            return method(*args, **kwargs)

        return refusing

    accelerator.save_state = guarded(accelerator.save_state, loading=False)
    accelerator.load_state = guarded(accelerator.load_state, loading=True)
    accelerator._overlapkit_checkpoints_guarded = True


def watch_forwards_past_ddp(ddp_model: torch.nn.Module) -> None:
    """Note, on ``ddp_model`` (once), whether a forward with gradients on went through the
    DDP wrapper since the last ``accelerator.backward``, and whether its module ran one
    in training mode outside it (past DDP: ``unwrap_model(model)(batch)``). Module
    forward hooks; the wrapper's end is noted even when its forward raises."""
    if getattr(ddp_model, FORWARDS, None) is not None:
        return
    seen = {"depth": 0, "through": False, "past": False}

    def enter(module: torch.nn.Module, args: Any) -> None:
        seen["depth"] += 1
        seen["through"] = seen["through"] or torch.is_grad_enabled()

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        seen["depth"] -= 1

    def inner(module: torch.nn.Module, args: Any) -> None:
        if not seen["depth"] and torch.is_grad_enabled() and module.training:
            seen["past"] = True

    ddp_model.register_forward_pre_hook(enter)
    ddp_model.register_forward_hook(leave, always_call=True)
    module = ddp_model.module
    assert isinstance(module, torch.nn.Module)
    module.register_forward_pre_hook(inner)
    setattr(ddp_model, FORWARDS, seen)


def forward_past_ddp_refusal(models: Iterable[torch.nn.Module], technique: Any,
                             where: str = ACCELERATE_PAST, fix: str = ACCELERATE_FIX,
                             ) -> ConfigurationError | None:
    """As a backward starts (``accelerator.backward``, the Trainer's after
    ``compute_loss``): the refusal of a backward whose forwards since the last check all
    went past the DDP wrapper of one of ``models`` (none through it), or None; what was
    noted is cleared either way. ``technique(model)`` names the technique set up on it;
    ``where`` says how the forward went past, ``fix`` what to do."""
    refusal = None
    for model in models:
        seen = getattr(model, FORWARDS, None)
        if seen is None:
            continue
        past, through = seen["past"], seen["through"]
        seen["past"] = seen["through"] = False
        if past and not through and refusal is None:
            refusal = ConfigurationError(
                f"the model's forward ran past DistributedDataParallel ({where}, with "
                "gradients on, in training mode): its backward reduces no gradient across "
                "the ranks (the plain loop then steps each rank on its own gradients, "
                f"which drift apart) and {technique(model)} steps what DDP reduces. Nothing "
                f"was stepped. {fix}")
    return refusal
