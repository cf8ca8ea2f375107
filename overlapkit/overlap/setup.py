"""The steps of the set-up pass (:mod:`overlapkit.overlap.resolved`) shared by the
overlapped techniques: resolve the engine class, materialise and check ``params``,
build the real optimizer, and claim its parameters.

Everything here runs once, when :func:`overlapkit.overlap_ddp` or
:func:`overlapkit.optimizer_in_backward` is called (or at ``add_param_group``), never
per bucket or per step, and turns bad input into an :class:`~overlapkit.OverlapkitError`
before any hook is registered.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from overlapkit.errors import (
    ConfigurationError,
    PluginValidationError,
    UnsupportedOptimizerError,
)
from overlapkit.overlap.core.engine import OverlapEngine
from overlapkit.overlap.plain_step_guard import claims_changed, release_advice
from overlapkit.overlap.plain_step_guard import install as install_plain_step_guard
from overlapkit.overlap.rules.late_clipping import stepper_gone, unwatch
from overlapkit.overlap.scaler_guard import install as install_scaler_guard
from overlapkit.plugin.manager import get_plugin_manager

__all__ = ["build_optimizer", "check_params_belong", "check_steppable", "check_unclaimed",
           "claim_params", "flatten_params", "materialise_params", "optimizer_probe",
           "resolve_overlapped_cls", "unclaim_params"]

# parameter -> the technique stepping it during backward. Weak keys: a parameter's
# claim dies with it (and is never pickled with it, unlike a tensor attribute).
_CLAIMS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def resolve_overlapped_cls(optim_cls: Any) -> type[OverlapEngine]:
    """The registered :class:`OverlapEngine` subclass for ``optim_cls`` (most
    specific class in its MRO wins), after its ``check_supported``.

    :raises UnsupportedOptimizerError: not an optimizer class, or one the engine
        cannot step part by part (LBFGS, SparseAdam).
    :raises PluginValidationError: a plugin registered something that is not an engine.
    """
    provider = get_plugin_manager().registry.optimizer_provider(optim_cls)
    overlapped_cls = provider.record.overlapped_cls
    if not (isinstance(overlapped_cls, type)
            and issubclass(overlapped_cls, OverlapEngine)):
        raise PluginValidationError(
            provider.plugin,
            f"its OptimizerRecord for {optim_cls.__qualname__} names {overlapped_cls!r}, "
            "which is not an overlapkit.OverlapEngine subclass; subclass it.",
        )
    overlapped_cls.check_supported(optim_cls)
    return overlapped_cls


#: what the optimizer's own constructor raises for some ``params`` (None: accepted)
ParamsProbe = Callable[[Any], "BaseException | None"]


def optimizer_probe(optim_cls: Any, args: Sequence[Any],
                    optim_kwargs: Mapping[str, Any]) -> ParamsProbe:
    """A :data:`ParamsProbe` building ``optim_cls(params, *args, **optim_kwargs)``, so
    a refusal of ``params`` is chained to the optimizer's own error for it. Building an
    optimizer only records its arguments (state is created at the first step), so the
    probe changes nothing; it is called only on input already known to be bad."""
    def probe(params: Any) -> BaseException | None:
        try:
            optim_cls(params, *args, **optim_kwargs)
        except Exception as exc:  # the optimizer's own error, to chain to
            return exc
        return None
    return probe


def materialise_params(params: Any, probe: ParamsProbe | None = None) -> list[Any]:
    """``params`` as a list whose group dicts are copies holding their ``"params"`` as a
    list, when given as a one-shot iterator (``module.parameters()``).

    Call it once, before any check reads the parameters: a check that iterates a
    generator would leave the optimizer an empty group, whose parameters would then
    silently never be trained.

    :param probe: what the optimizer raises for the bad ``params`` (see
        :func:`optimizer_probe`); the ConfigurationError is chained to it.
    :raises ConfigurationError: ``params`` is a single tensor or not iterable, or a
        param-group dict has no ``"params"``.
    """
    def original(bad: Any) -> BaseException | None:
        return probe(bad) if probe is not None else None

    if isinstance(params, torch.Tensor):
        raise ConfigurationError(
            f"params must be an iterable of parameters or param-group dicts, got a single "
            f"tensor of shape {tuple(params.shape)}; pass a list: params=[tensor]."
        ) from original(params)
    if isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Iterable):
        raise ConfigurationError(
            f"params must be an iterable of parameters or param-group dicts, got "
            f"{type(params).__name__}; pass e.g. model.parameters() or "
            "[{'params': [...], 'lr': ...}, ...]."
        ) from original(params)
    out: list[Any] = []
    for index, item in enumerate(params):
        if isinstance(item, Mapping):
            if "params" not in item:
                raise ConfigurationError(
                    f"param group {index} has no 'params' entry (keys: {sorted(item)}); "
                    "each group dict needs 'params': [the group's parameters]."
                ) from original([item])
            inner = item["params"]
            if isinstance(inner, Iterator):
                item = {**item, "params": list(inner)}
        out.append(item)
    return out


def flatten_params(params: Iterable[Any]) -> list[Any]:
    """The items of ``params`` (tensors or param-group dicts), group dicts opened."""
    flat: list[Any] = []
    for item in params:
        if isinstance(item, Mapping):
            inner = item.get("params", [])
            flat.extend([inner] if isinstance(inner, torch.Tensor) else list(inner))
        else:
            flat.append(item)
    return flat


def check_params_belong(
    params: Iterable[Any], members: Mapping[int, str], *, owner: str, example: str,
    unknown: str,
) -> list[torch.Tensor]:
    """Every item of ``params`` (group dicts opened) is a tensor whose ``id`` is in
    ``members``, listed once; returns them.

    :param members: ``id(param)`` -> its name in the model, for messages.
    :param owner: what they must belong to, for messages ("the DDP model").
    :param example: what to pass instead ("ddp_model.parameters()").
    :param unknown: the end of the message for a tensor that does not belong.
    :raises ConfigurationError: naming the offending item; a parameter listed twice
        (a plain optimizer would step it twice per step, or refuse it).
    """
    tensors = []
    seen: set[int] = set()
    for param in flatten_params(params):
        if not isinstance(param, torch.Tensor):
            raise ConfigurationError(
                f"params must hold parameters of {owner} (tensors or param-group "
                f"dicts), got {type(param).__name__}; pass e.g. {example}."
            )
        if id(param) not in members:
            raise ConfigurationError(
                f"a parameter of shape {tuple(param.shape)} in params is not a parameter "
                f"of {owner}, {unknown}"
            )
        if id(param) in seen:
            raise ConfigurationError(
                f"parameter {members[id(param)]!r} is listed more than once in params; "
                "list each parameter once (tied weights are one parameter: pass "
                f"{example}, which lists it once)."
            )
        seen.add(id(param))
        tensors.append(param)
    return tensors


def build_optimizer(
    optim_cls: type[torch.optim.Optimizer],
    params: Sequence[Any],
    args: Sequence[Any],
    optim_kwargs: Mapping[str, Any],
    technique: str,
) -> torch.optim.Optimizer:
    """``optim_cls(params, *args, **optim_kwargs)``.

    :raises ConfigurationError: the optimizer rejected its arguments.
    :raises UnsupportedOptimizerError: ``optim_cls(...)`` is not an optimizer.
    """
    try:
        optimizer = optim_cls(params, *args, **optim_kwargs)
    except Exception as exc:  # whatever the constructor raises, it is about the arguments
        culprit = _rejected_argument(optim_cls, params, args, optim_kwargs)
        which = f" (the argument {culprit})" if culprit else ""
        raise ConfigurationError(
            f"{optim_cls.__qualname__} rejected the arguments {technique} passed on"
            f"{which}: {type(exc).__name__}: {exc}. Fix the optimizer arguments (they are "
            "the plain optimizer's)." + _zero_s_arguments(optim_kwargs)
        ) from exc
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"{optim_cls.__qualname__}(...) did not return a torch.optim.Optimizer; "
            "pass an optimizer class."
        )
    return optimizer


#: where torch's ``capturable`` steps run (``_get_capturable_supported_devices``), should
#: that private helper go
_CAPTURABLE_DEVICES = ("cuda", "xpu", "hpu", "privateuseone", "xla")


def _capturable_devices() -> tuple[str, ...]:
    """The device types torch's ``capturable=True`` (not fused) step accepts."""
    try:
        from torch.optim.optimizer import _get_capturable_supported_devices
        return tuple(_get_capturable_supported_devices(supports_xla=True))
    except (ImportError, TypeError):
        return _CAPTURABLE_DEVICES


def check_steppable(optimizer: torch.optim.Optimizer, groups: Sequence[Mapping[str, Any]],
                    names: Mapping[int, str], technique: str, *, added: bool = False
                    ) -> None:
    """Refuse, at set-up (or ``add_param_group``), the optimizer options with which
    torch's own ``step()`` cannot step ``groups``' parameters, in the plain loop either:
    ``differentiable=True`` on the optimizer (its step runs with autograd on, and torch
    refuses the in-place update of a leaf that requires grad; a group's own
    ``differentiable=True`` steps under ``no_grad`` and is honoured), and a group's
    ``capturable=True``, not fused, over a parameter on a device the capturable step
    does not take (CPU). Without this the first ``backward()`` raised torch's own error
    from inside the hooks. A ``step()`` the optimizer's class wrote itself is left to it.

    :param groups: param-group dicts, partial ones filled from ``optimizer.defaults``.
    :param names: ``id(param)`` -> its name, for the message.
    :param added: ``groups`` is the one group given to ``add_param_group``.
    :raises ConfigurationError: such an option, naming it and what to do.
    """
    cls = type(optimizer)
    torch_step = getattr(cls.step, "__module__", "").startswith("torch.optim")
    if torch_step and optimizer.defaults.get("differentiable"):
        raise ConfigurationError(
            f"{cls.__qualname__}(differentiable=True) cannot step the model's parameters: "
            "torch's step() then runs with autograd on and updates each parameter in "
            "place, which torch refuses for a leaf tensor that requires grad (a plain "
            "loop's step() raises 'a leaf Variable that requires grad is being used in an "
            "in-place operation' too). differentiable=True is for differentiating through "
            f"the update of non-leaf tensors, which {technique} does not step; build the "
            "optimizer without it.")
    devices = _capturable_devices()
    for index, given in enumerate(groups):
        group = {**optimizer.defaults, **given}
        if not torch_step or not group.get("capturable") or group.get("fused"):
            continue
        bad = [p for p in flatten_params([given]) if p.device.type not in devices]
        if bad:
            where = names.get(id(bad[0]), "a parameter")
            fused = (" or fused=True, whose kernel takes capturable on CPU"
                     if "fused" in group else "")
            which = "the param group added" if added else f"param group {index}"
            raise ConfigurationError(
                f"{cls.__qualname__} with capturable=True ({which}) cannot "
                f"step {where!r} on {bad[0].device}: torch's capturable step takes "
                f"parameters on {', '.join(devices)} only (a plain loop's step() fails "
                "with torch's AssertionError 'If capturable=True, params and state_steps "
                "must be on supported devices' too). capturable is for CUDA graphs: pass "
                f"capturable=False{fused}.")


#: ``ZeroRedundancyOptimizer``'s own arguments, which a port of a ZeRO loop passes on
ZERO_ARGUMENTS = ("process_group", "parameters_as_bucket_view", "overlap_with_ddp")


def _zero_s_arguments(optim_kwargs: Mapping[str, Any]) -> str:
    """What to do with ``ZeroRedundancyOptimizer``'s arguments among ``optim_kwargs``
    (which reached the optimizer as its own: its bare ``TypeError``), or ``""``."""
    named = [name for name in ZERO_ARGUMENTS if name in optim_kwargs]
    if not named:
        return ""
    return (f" {', '.join(named)} {'is' if len(named) == 1 else 'are'} "
            "ZeroRedundancyOptimizer's: overlap_ddp(..., shard_optimizer_state=True) "
            "shards over the DDP model's process group (pass process_group= to "
            "DistributedDataParallel) and overlaps the step with backward itself, so "
            "drop them.")


def _rejected_argument(optim_cls: type[torch.optim.Optimizer], params: Sequence[Any],
                       args: Sequence[Any], optim_kwargs: Mapping[str, Any]) -> str | None:
    """The keyword argument without which ``optim_cls`` accepts the others, as
    ``name=value``; None when no single one is to blame. Building an optimizer only
    records its arguments (state is created at the first step), so the retries change
    nothing."""
    for name in optim_kwargs:
        others = {k: v for k, v in optim_kwargs.items() if k != name}
        try:
            optim_cls(params, *args, **others)
        except Exception:  # not this one
            continue
        return f"{name}={optim_kwargs[name]!r}"
    return None


def _live_claim(param: torch.Tensor) -> str | None:
    """The technique claiming ``param``, None when none does or its stepper is gone
    (the claim is then lifted)."""
    owner = _CLAIMS.get(param)
    if owner is not None and stepper_gone(param):
        del _CLAIMS[param]
        unwatch([param])
        return None
    return owner


def check_unclaimed(params: Iterable[torch.Tensor], technique: str) -> None:
    """Refuse parameters that another overlapkit technique, or torch's
    ``_apply_optimizer_in_backward``, already steps during backward.

    A claim ends with the stepper that made it: once the optimizer and the model
    stepping a parameter are dropped, a new model wrapping the same module may be set
    up (measured before: the same module wrapped in a new DDP model after the first was
    dropped was refused, and the first one's optimizer state stayed alive).

    :raises ConfigurationError: naming who steps them.
    """
    collected = False
    for param in params:
        owner = _live_claim(param)
        if owner is not None and not collected:
            gc.collect()  # a dropped optimizer may be waiting in a reference cycle
            collected = True
            owner = _live_claim(param)
        if owner is None and hasattr(param, "_in_backward_optimizers"):
            owner = "torch.distributed.optim._apply_optimizer_in_backward"
        if owner is not None:
            raise ConfigurationError(
                f"a parameter of shape {tuple(param.shape)} is already stepped during "
                f"backward by {owner}, so {technique} would step it a second time; make "
                "one call per parameter (pass params= to split the parameters between "
                "calls), and do not mix overlap_ddp and optimizer_in_backward on one model "
                "(or call release() on the earlier optimizer first)."
                + (release_advice(owner) if owner in ("overlap_ddp", "optimizer_in_backward")
                   else "")
            )


def claim_params(params: Iterable[torch.Tensor], technique: str) -> None:
    """Record that ``technique`` steps ``params`` during backward from now on; a plain
    optimizer stepping them is refused (:mod:`~overlapkit.overlap.plain_step_guard`)."""
    install_plain_step_guard()
    install_scaler_guard()
    claims_changed()
    for param in params:
        _CLAIMS[param] = technique


def unclaim_params(params: Iterable[torch.Tensor]) -> None:
    """Lift the claim of :func:`claim_params`: nothing steps ``params`` during backward
    any more (the optimizer was released)."""
    for param in params:
        _CLAIMS.pop(param, None)
