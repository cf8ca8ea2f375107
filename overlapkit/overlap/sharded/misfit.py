"""Whether a whole state dict fits a sharded optimizer's parameters, decided before
anything is loaded: :func:`misfit_refusal`, tried on meta-device twins.

A plain optimizer loads a dict that does not fit (another model's) and raises at its
first step on every rank; a sharded one steps each parameter on its owner only, so only
some ranks would raise. Used by the sharded optimizer's ``load_state_dict``.

.. versionadded:: 0.4
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.core.group_sizes import sizes_refusal
from overlapkit.overlap.sharded.torch_api import TEMPLATE_DEVICE_KEY

__all__ = ["misfit_refusal", "sizes_refusal"]


def _on_meta(value: Any) -> Any:
    """``value`` with every tensor replaced by a meta twin (same shape and dtype, no
    memory), but scalars (a ``step`` count, which the step reads back as a number)
    copied; load templates' device entries left out."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if value.dim() == 0 else torch.empty_like(
            value, device="meta")
    if isinstance(value, Mapping):
        return {key: _on_meta(item) for key, item in value.items()
                if key != TEMPLATE_DEVICE_KEY}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_meta(item) for item in value)
    return value


def _scalars_back(twin: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Put ``state_dict``'s scalar state (NAdam's ``mu_product``) back into ``twin``
    as given: its load moved them onto the meta device with the parameters, where the
    step cannot read them back as numbers (the real load keeps them where the real
    parameters are)."""
    saved = [key for group in state_dict["param_groups"] for key in group["params"]]
    params = [param for group in twin.param_groups for param in group["params"]]
    for key, param in zip(saved, params, strict=False):
        for name, value in state_dict["state"].get(key, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                twin.state[param][name] = value.detach().clone()


def _twin_of(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and param groups over meta twins of its
    parameters, each that requires grad holding a zero gradient."""
    groups = []
    for group in optimizer.param_groups:
        twins = []
        for param in group["params"]:
            twin = torch.empty_like(param, device="meta")
            if param.requires_grad:
                twin.requires_grad_(True)
                twin.grad = torch.zeros_like(twin)
            twins.append(twin)
        groups.append({**group, "params": twins})
    optim_cls: Any = type(optimizer)
    return optim_cls(groups)


def misfit_refusal(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any],
                   model: torch.nn.Module | None = None) -> ConfigurationError | None:
    """The refusal of loading ``state_dict`` (the whole one, on every rank alike) when a
    step after it would raise, else None: tried on a twin of ``optimizer`` over meta
    tensors (no memory, nothing computed, torch's step hooks left out), after a step
    of a fresh twin shows that the optimizer steps on meta tensors at all.

    A plain optimizer loads a state dict that does not fit its parameters (another
    model's: state of another shape, a param group without a setting) and raises at
    its first step, on every rank. A sharded one steps each parameter on its owner
    only: only those ranks raised, at the end of backward, and the others went on
    training (measured: 2 gloo ranks, AdamW, torch's ``RuntimeError`` "The size of
    tensor a (7) must match the size of tensor b (24)" on rank 0, nothing on rank 1).
    First, param groups of other sizes (:func:`sizes_refusal`, ``model`` naming the
    frozen parameters left out)."""
    if (sizes := sizes_refusal(optimizer, state_dict, model)) is not None:
        return sizes
    step = inspect.unwrap(type(optimizer).step)  # without torch's step hooks
    try:
        with torch.no_grad():
            step(_twin_of(optimizer))
        loaded = _twin_of(optimizer)
        loaded.load_state_dict(_on_meta(dict(state_dict)))
        _scalars_back(loaded, state_dict)
    except Exception:  # not decidable on meta tensors; or torch's own load error follows
        return None
    try:
        with torch.no_grad():
            step(loaded)
    except Exception as error:
        return ConfigurationError(
            "this state dict does not fit the optimizer's parameters: a step after loading "
            f"it raises {type(error).__name__}: {error} (tried on the meta device, on every "
            "rank). A plain optimizer would load it and raise at its first step; here each "
            "parameter steps on its owning rank only, so only some ranks would raise and "
            "the others go on. Nothing was loaded. Load a state dict saved for these "
            "parameters and param groups (the same model and optimizer).")
    return None
