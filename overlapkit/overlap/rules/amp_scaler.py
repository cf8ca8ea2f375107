"""How a ``torch.amp.GradScaler`` meets an optimizer whose steps happen during backward.

With ``grad_scaler=`` the gradients are unscaled, checked for infs and stepped (or the
step skipped) at the end of backward (:mod:`overlapkit.overlap.rules.global_step`); the
user's ``scaler.step(opt)`` then only hands the scaler the inf check, which
``scaler.update()`` reads. Everything else is refused with a clear error before it
changes anything:

- a scaler driving an optimizer built without ``grad_scaler=`` (its steps used the
  scaled gradients, with no inf check): at ``scaler.step(opt)`` and at
  ``scaler.unscale_(opt)``;
- ``scaler.unscale_(opt)`` with ``grad_scaler=``: the step it would prepare (clipping
  the unscaled gradients, typically) was already taken; clip with ``clip_grad_norm=``.

``GradScaler.unscale_`` has no hook, but it reads ``optimizer.param_groups`` from
``GradScaler._unscale_grads_`` before touching a gradient: :func:`guard_param_groups`
recognises that caller by its code object (one frame look-up per ``param_groups``
read), FSDP's ``ShardedGradScaler``'s own as well (0.4.0 recognised only
``GradScaler``'s: ``ShardedGradScaler.unscale_(opt)`` unscaled the kept gradients in
place, silently).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from contextlib import suppress
from types import CodeType, FrameType, ModuleType
from typing import Any

import torch

from overlapkit.errors import ConfigurationError

__all__ = ["SCALERS", "SHARDED_SCALER_MODULE", "guard_param_groups", "hand_inf_check",
           "refuse_scaler_step", "scaler_refusal", "when_scaler_imported"]


#: FSDP's scaler's module: importing it imports FSDP and DTensor (1.5 s of CPU on torch
#: 2.13, more than overlapkit and DDP together), which a loop without FSDP never needs
SHARDED_SCALER_MODULE = "torch.distributed.fsdp.sharded_grad_scaler"

#: the scaler classes whose unscale is recognised: ``torch.amp.GradScaler``, and FSDP's
#: ``ShardedGradScaler`` (its own ``unscale_`` and ``_unscale_grads_``: 0.4.0 did not see
#: it unscale the kept gradients in place) from when its module is imported
SCALERS: list[type[torch.amp.GradScaler]] = []
#: their ``_unscale_grads_`` and torch's own ``unscale_`` (:mod:`overlapkit.overlap.
#: scaler_guard` wraps it), which calls it
_UNSCALE_GRADS: set[CodeType] = set()
_UNSCALE: set[CodeType] = set()
#: what :func:`when_scaler_imported` runs for each scaler class, now and later
_ON_SCALER: list[Callable[[type[torch.amp.GradScaler]], None]] = []


def _recognise(cls: type[torch.amp.GradScaler]) -> None:
    """Add ``cls`` to :data:`SCALERS` and run what waits for a scaler class."""
    if cls in SCALERS:
        return
    SCALERS.append(cls)
    _UNSCALE_GRADS.add(cls._unscale_grads_.__code__)
    _UNSCALE.add(getattr(cls.unscale_, "__wrapped__", cls.unscale_).__code__)
    for callback in _ON_SCALER:
        callback(cls)


def when_scaler_imported(callback: Callable[[type[torch.amp.GradScaler]], None]) -> None:
    """Run ``callback`` on each scaler class of :data:`SCALERS`, and on FSDP's
    ``ShardedGradScaler`` when its module is imported, if it is later."""
    _ON_SCALER.append(callback)
    for cls in list(SCALERS):
        callback(cls)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Recognises ``ShardedGradScaler`` as its module is imported (a finder on
    ``sys.meta_path`` that leaves the finding to the others and runs after the
    module's own code), so that ``import overlapkit.overlap`` does not import FSDP."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != SHARDED_SCALER_MODULE:
            return None
        with suppress(ValueError):
            sys.meta_path.remove(self)  # once; the other finders find it
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_recognise(module: ModuleType) -> None:
            exec_module(module)
            scaler = getattr(module, "ShardedGradScaler", None)
            if isinstance(scaler, type):
                _recognise(scaler)

        loader.exec_module = exec_then_recognise
        return spec


_recognise(torch.amp.GradScaler)
if SHARDED_SCALER_MODULE in sys.modules:
    _recognise(sys.modules[SHARDED_SCALER_MODULE].ShardedGradScaler)
else:
    sys.meta_path.insert(0, _AfterImport())


def scaler_refusal(technique: str) -> ConfigurationError:
    """The error for a GradScaler driving an optimizer built without ``grad_scaler=``."""
    return ConfigurationError(
        f"a torch.amp.GradScaler is driving the optimizer of {technique}, which was "
        "built without grad_scaler=: its steps during backward used the scaled "
        "gradients, with no inf check. Pass the scaler when setting up: "
        f"{technique}(..., grad_scaler=scaler); the loop stays "
        "scaler.scale(loss).backward(); scaler.step(opt); scaler.update()."
    )


def guard_param_groups(caller: FrameType | None, technique: str,
                       grad_scaler: Any | None) -> None:
    """Called on each read of the facade's ``param_groups`` with the reader's frame.

    :raises ConfigurationError: the reader is ``GradScaler.unscale_`` (through
        ``_unscale_grads_``): without ``grad_scaler=`` the steps used scaled
        gradients; with it the gradients are already unscaled and stepped, so what the
        user meant to do between ``unscale_`` and ``step`` (clip) would change nothing.
        Raised before any gradient is touched.
    """
    if caller is None or caller.f_code not in _UNSCALE_GRADS:
        return
    outer = caller.f_back
    if outer is None or outer.f_code not in _UNSCALE:
        return  # GradScaler.step's own inf check: step() answers it
    if grad_scaler is None:
        raise scaler_refusal(technique)
    raise ConfigurationError(
        f"scaler.unscale_(opt) on the optimizer of {technique}: with grad_scaler= the "
        "gradients are unscaled, checked and stepped at the end of backward, so "
        "whatever comes between unscale_ and step (clipping the unscaled gradients) "
        "would no longer change the step. Leave out scaler.unscale_(opt) and clip with "
        f"{technique}(..., clip_grad_norm=max_norm) (torch's global clip_grad_norm_, "
        "on the unscaled gradients); the loop is scaler.scale(loss).backward(); "
        "scaler.step(opt); scaler.update()."
    )


def refuse_scaler_step(optimizer: torch.optim.Optimizer, technique: str,
                       grad_scaler: Any | None) -> Any | None:
    """Called first by the facade's ``step()``: the ``grad_scaler=`` scaler when a
    ``GradScaler`` is calling it (it set ``grad_scale``/``found_inf`` on the optimizer,
    ``_step_supports_amp_scaling``), None when no scaler is.

    :raises ConfigurationError: a scaler drives an optimizer built without
        ``grad_scaler=`` (raised leaving no attribute behind).
    """
    attrs = optimizer.__dict__
    if "found_inf" not in attrs and "grad_scale" not in attrs:
        return None
    if grad_scaler is None:
        # GradScaler.step deletes them after a step that returns; this one raises
        attrs.pop("found_inf", None)
        attrs.pop("grad_scale", None)
        raise scaler_refusal(technique)
    return grad_scaler


def hand_inf_check(optimizer: torch.optim.Optimizer, grad_scaler: Any,
                   found_inf_per_device: dict[torch.device, torch.Tensor]) -> None:
    """Give ``grad_scaler`` the inf check of the step just taken for ``optimizer``,
    which ``scaler.update()`` reads (it replaces the check ``GradScaler.step`` made on
    the gradients before calling ``step()``)."""
    state = grad_scaler._per_optimizer_states[id(optimizer)]
    state["found_inf_per_device"] = dict(found_inf_per_device)
