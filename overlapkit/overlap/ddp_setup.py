"""The DDP set-up shared by ``overlap_ddp`` and ``optimizer_in_backward``: checks of
the model, its parameters and the clipping options, then the registration of one
:class:`~overlapkit.overlap.bucket_stepper.BucketStepper` comm hook.

Everything here runs once, at set-up, before any state changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from overlapkit.errors import ConfigurationError, UnsupportedModelError
from overlapkit.overlap.bucket_stepper import BucketStepper, overlapped_comm_hook
from overlapkit.overlap.clipping import GradClipping
from overlapkit.overlap.engine import OverlapEngine
from overlapkit.overlap.global_step import check_grad_scaler, model_order, step_rules
from overlapkit.overlap.setup import (
    build_engine,
    check_params_belong,
    check_unclaimed,
    claim_params,
    materialise_params,
    optimizer_probe,
)
from overlapkit.overlap.side_stream import SideStream
from overlapkit.plugin.manager import get_plugin_manager
from overlapkit.plugin.records import CommHookRecord

__all__ = ["check_clipping_for_model", "check_comm_hook_options", "check_ddp_model",
           "check_params_in_ddp_model", "ddp_params", "register_bucket_stepper",
           "set_up_on_ddp"]

# set on a DDP model to the technique whose comm hook it carries
_MARKER = "_overlapkit_comm_hook_technique"


def ddp_params(model: DistributedDataParallel) -> list[torch.nn.Parameter]:
    """The parameters DDP reduces (requires_grad, not in its parameters to ignore)."""
    return [p for p in DistributedDataParallel._get_data_parallel_params(model.module)
            if p.requires_grad]


def check_params_in_ddp_model(model: DistributedDataParallel, params: Iterable[Any]) -> None:
    """:raises ConfigurationError: an item of ``params`` is not a parameter of the model,
    or a trainable one DDP does not reduce. Frozen parameters (``requires_grad=False``)
    are accepted, as torch's optimizers accept them: they never get a gradient, so they
    are never stepped and have no state."""
    managed = {id(p) for p in ddp_params(model)}
    in_model = {id(p): name for name, p in model.module.named_parameters()}
    for param in check_params_belong(
        params, in_model, owner="the DDP model", example="ddp_model.parameters()",
        unknown="so no bucket ever holds its gradient; pass only the model's parameters "
        "(ddp_model.parameters()), and step others with a plain optimizer.",
    ):
        if id(param) not in managed and param.requires_grad:
            raise ConfigurationError(
                f"parameter {in_model[id(param)]!r} in params is trainable but not "
                "reduced by DDP (in DDP's parameters to ignore, or frozen when "
                "DistributedDataParallel was built and unfrozen since), so no bucket ever "
                "holds its gradient and it would never be stepped; leave it out of params "
                "(step it with a plain optimizer), or unfreeze it before building DDP."
            )


def check_ddp_model(ddp_model: Any, technique: str) -> DistributedDataParallel:
    """:raises UnsupportedModelError: not DDP. :raises ConfigurationError: it already
    has a comm hook (overlapkit's or another)."""
    if not isinstance(ddp_model, DistributedDataParallel):
        raise UnsupportedModelError(
            f"{technique} needs a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}; wrap it first: DistributedDataParallel(model)."
        )
    done = getattr(ddp_model, _MARKER, None)
    if done == technique:
        raise ConfigurationError(
            f"{technique} was already called on this DDP model, and a DDP model takes one "
            f"comm hook; make one {technique} call per model (pass params= to leave "
            "parameters to a plain optimizer stepped after backward)."
        )
    if done is not None:
        raise ConfigurationError(
            f"{done} was already called on this DDP model, and a DDP model takes one comm "
            f"hook, so {technique} cannot add its own; choose one of overlap_ddp and "
            "optimizer_in_backward per model."
        )
    if getattr(ddp_model, "_comm_hooks", None):
        raise ConfigurationError(
            "this DDP model already has a comm hook registered, and a DDP model takes "
            f"one; do not register it yourself: pass its name as {technique}(..., "
            "comm_hook=NAME) and overlapkit runs it before stepping."
        )
    return ddp_model


def check_clipping_for_model(model: DistributedDataParallel, clipping: GradClipping,
                             technique: str) -> None:
    """:raises ConfigurationError: per-bucket norm clipping on a model whose buckets are
    stepped according to each rank's own parameter usage (``find_unused_parameters`` or
    ``static_graph``), where ranks would clip different sets of gradients together
    and their replicas drift apart. Global clipping (the default scope) steps after
    DDP's finalize, where every rank has the same gradients, and is allowed."""
    if clipping.norm is None or clipping.scope != "bucket" or not (
            model.find_unused_parameters or model.static_graph):
        return
    option = "find_unused_parameters" if model.find_unused_parameters else "static_graph"
    raise ConfigurationError(
        f"clip_grad_norm_scope='bucket' cannot be used with a DDP model built with "
        f"{option}=True: "
        "there each bucket steps only the parameters this rank used, and the others "
        "after backward, so the gradients clipped together (and the clipped values) "
        "would differ between ranks and the replicas would drift apart. Use "
        "the default clip_grad_norm_scope='global' (exact), clip_grad_value, or build "
        f"the DDP model without {option} ({technique})."
    )


def check_comm_hook_options(options: Any) -> dict[str, Any]:
    """:raises ConfigurationError: ``options`` is not a mapping."""
    if options is not None and not isinstance(options, Mapping):
        raise ConfigurationError(
            f"comm_hook_options must be a dict of the hook's options, got "
            f"{type(options).__name__}."
        )
    return dict(options or {})


def register_bucket_stepper(
    model: DistributedDataParallel,
    engine: OverlapEngine,
    hook_spec: CommHookRecord,
    hook_options: dict[str, Any],
    technique: str,
    stepper_cls: type[BucketStepper] = BucketStepper,
    **stepper_options: Any,
) -> BucketStepper:
    """Build the comm hook of ``hook_spec`` and register a :class:`BucketStepper`
    (``stepper_cls``: a subclass, for sharded optimizer state) running it, then stepping
    ``engine``, on ``model``. ``stepper_options`` are :class:`BucketStepper`'s keyword
    arguments but ``track_usage`` and ``grads_are_bucket_views``, which are read from
    the model."""
    inner_state, inner_hook = hook_spec.create(process_group=model.process_group,
                                              **hook_options)
    track_usage = bool(model.find_unused_parameters or model.static_graph)
    stepper = stepper_cls(
        engine, inner_state, inner_hook, track_usage=track_usage,
        grads_are_bucket_views=bool(model.gradient_as_bucket_view), technique=technique,
        **stepper_options,
    )
    try:
        model.register_comm_hook(stepper, overlapped_comm_hook)
    except RuntimeError as exc:
        raise ConfigurationError(
            f"DDP refused the comm hook: {exc}. A DDP model takes one comm hook; if you "
            "registered one (or a builtin one) yourself, remove it and pass its name as "
            "comm_hook=."
        ) from exc
    setattr(model, _MARKER, technique)
    stepper.model_before_rebuild = model
    # DDP lays its buckets out again after the first backward, except where it tracks
    # parameter usage; checkpoints record that second layout (checkpoint.ddp_buckets)
    stepper.recording_layout = not (model.find_unused_parameters or model.static_graph)
    # Only now that the comm hook is in: hooks left on the parameters after a refused
    # registration would keep freeing gradients nobody steps.
    if stepper.free_grads and not model.gradient_as_bucket_view:
        stepper.free_after_copy_model = model
    stepper.register(engine.parameters())
    managed = {id(p) for p in ddp_params(model)}
    names = {id(p): name for name, p in model.module.named_parameters()}
    stepper.frozen = [(names[id(p)], p) for p in engine.parameters()
                      if id(p) not in managed]
    return stepper


def set_up_on_ddp(
    model: DistributedDataParallel,
    overlapped_cls: type[OverlapEngine],
    optim_cls: type[torch.optim.Optimizer],
    args: tuple[Any, ...],
    optim_kwargs: dict[str, Any],
    params: Iterable[Any] | None,
    comm_hook: str,
    comm_hook_options: Mapping[str, Any] | None,
    clipping: GradClipping,
    technique: str,
    *,
    with_side_stream: bool = False,
    grad_scaler: Any | None = None,
    **stepper_options: Any,
) -> tuple[OverlapEngine, BucketStepper]:
    """The DDP set-up of ``overlap_ddp`` and ``optimizer_in_backward``, in one order:
    every check (comm hook name and options, clipping, params, optimizer arguments,
    parameters claimed by another technique) before the one change, the comm hook's
    registration; then the parameters are claimed. ``stepper_options`` go to
    :class:`~overlapkit.overlap.bucket_stepper.BucketStepper`; ``with_side_stream``
    gives it a side stream on the parameters' device."""
    hook_spec = get_plugin_manager().registry.comm_hook(comm_hook)
    hook_options = check_comm_hook_options(comm_hook_options)
    check_grad_scaler(grad_scaler)
    check_clipping_for_model(model, clipping, technique)
    if params is None:
        params = ddp_params(model)
    else:
        params = materialise_params(params, optimizer_probe(optim_cls, args, optim_kwargs))
        check_params_in_ddp_model(model, params)
    engine = build_engine(overlapped_cls, optim_cls, params, args, optim_kwargs, technique)
    owned = engine.parameters()
    check_unclaimed(owned, technique)
    if with_side_stream:
        stepper_options["side_stream"] = SideStream(owned)
    stepper_options["global_step"], stepper_options["full_step"] = step_rules(
        clipping, grad_scaler, order=model_order(model.module.parameters()))
    stepper = register_bucket_stepper(model, engine, hook_spec, hook_options, technique,
                                      clipping=clipping, **stepper_options)
    if ((stepper.side_stream is not None and stepper.side_stream.active)
            or not stepper.free_grads or stepper.frozen):
        model.register_forward_pre_hook(lambda module, args: stepper.before_forward())
    claim_params(owned, technique)
    return engine, stepper
