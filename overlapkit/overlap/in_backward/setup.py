"""The set-up of ``optimizer_in_backward`` on a plain or FSDP2 module: which kind of
model it is, then, from the resolved set-up
(:class:`~overlapkit.overlap.resolved.ResolvedSetup`), a post-accumulate-grad hook per
parameter (:mod:`overlapkit.overlap.in_backward.param_stepper`) and the forward
pre-hooks that guard it. A DDP model takes the DDP path
(:mod:`overlapkit.overlap.ddp.setup`) instead.

On an accelerator the steps run on a side stream
(:mod:`overlapkit.overlap.core.side_stream`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from overlapkit.errors import ConfigurationError, UnsupportedModelError
from overlapkit.overlap.core.kept_graph import refusing_second_backwards
from overlapkit.overlap.core.own_hooks import OwnHook
from overlapkit.overlap.core.side_stream import SideStream
from overlapkit.overlap.in_backward.optimizer import TECHNIQUE, OptimizerInBackward
from overlapkit.overlap.in_backward.param_stepper import ParamStepper
from overlapkit.overlap.rebuild import before_forward_hook, plan_takeover, retire
from overlapkit.overlap.resolved import MODEL_KINDS, ResolvedSetup
from overlapkit.overlap.rules.global_step import step_rules
from overlapkit.overlap.setup import claim_params

__all__ = ["MODEL_KINDS", "model_kind", "replaceable", "set_up_on_module"]


def model_kind(module: Any) -> str:
    """``"ddp"``, ``"fsdp2"`` or ``"module"``; FSDP1 and a DDP inside refused.

    FSDP's classes are looked up only where ``torch.distributed.fsdp`` is imported
    already: a model holds no FSDP module otherwise, and importing it (with DTensor)
    costs 1.5 s of CPU on torch 2.13 that a loop without FSDP never needs.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp1 = getattr(fsdp, "FullyShardedDataParallel", ())
    fsdp2 = getattr(fsdp, "FSDPModule", ())
    if isinstance(module, DistributedDataParallel):
        return "ddp"
    if not isinstance(module, torch.nn.Module):
        raise UnsupportedModelError(
            f"{TECHNIQUE} needs a torch.nn.Module (plain, DistributedDataParallel or "
            f"fully_shard), got {type(module).__name__}."
        )
    kind = "module"
    for sub in module.modules():
        if isinstance(sub, fsdp1):
            raise UnsupportedModelError(
                f"{TECHNIQUE} does not support FSDP1 (FullyShardedDataParallel), whose "
                "flat parameters hide the per-parameter gradients; shard the model with "
                "torch.distributed.fsdp.fully_shard (FSDP2) instead."
            )
        if isinstance(sub, DistributedDataParallel):
            raise UnsupportedModelError(
                f"this module contains a DistributedDataParallel submodule; pass the DDP "
                f"model itself to {TECHNIQUE}, so that it steps after the allreduce."
            )
        if isinstance(sub, fsdp2):
            kind = "fsdp2"
    return kind


def set_up_on_module(setup: ResolvedSetup) -> OptimizerInBackward:
    """Build what ``setup`` resolved on a plain or FSDP2 module: a post-accumulate-grad
    hook per parameter, and the forward pre-hooks that guard it."""
    module = setup.model.model
    engine = setup.overlapped_cls(setup.optimizer)
    owned = engine.parameters()
    global_step, full_step = step_rules(setup.clipping, setup.grad_scaler,
                                        sharded=setup.model.kind == "fsdp2",
                                        order=setup.model.order)
    stepper = ParamStepper(engine, clipping=setup.clipping, side_stream=SideStream(owned),
                           global_step=global_step, full_step=full_step)
    # the one change: an earlier optimizer on these parameters stops stepping
    retire(plan_takeover(setup.stepped, TECHNIQUE, replaceable), TECHNIQUE)
    stepper.register(owned)
    if setup.model.kind == "module":
        # OwnHook: a copy of the module (an EMA's, torch.save's) is a plain module
        stepper.handles.append(module.register_forward_pre_hook(OwnHook(_refuse_inside_ddp)))
        names = setup.model.names
        anchors = [(names[id(p)], p) for p in (owned[0], owned[-1])]
        stepper.handles.append(module.register_forward_pre_hook(
            OwnHook(_refuse_replaced_parameters, anchors)))
    # a backward that raised leaves its scope open (on CPU a batch, on an accelerator
    # a side stream not joined), and a frozen parameter may have been unfrozen since
    stepper.handles.append(module.register_forward_pre_hook(
        OwnHook(before_forward_hook, stepper)))
    stepper.handles.append(module.register_forward_hook(refusing_second_backwards(stepper)))
    claim_params(owned, TECHNIQUE)
    return OptimizerInBackward(engine, stepper, setup.model)


def replaceable(stepper: object) -> bool:
    """Whether a new call on a plain or FSDP2 module may replace ``stepper``
    (:mod:`overlapkit.overlap.rebuild`): one of the same kind, not a DDP model's."""
    return isinstance(stepper, ParamStepper)


def _refuse_inside_ddp(module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook of a plain module stepped in backward: refuse to run inside a
    ``DistributedDataParallel`` forward.

    ``optimizer_in_backward(model)`` followed by ``DistributedDataParallel(model)`` (the
    order torch's ``_apply_optimizer_in_backward`` takes) would step each parameter on
    its *local* gradient, before DDP averages it: the replicas drift apart silently.
    DDP marks the module whose forward it is running (``_get_active_ddp_module``, what
    torch.compile reads too); one class-attribute read per forward.
    """
    active = DistributedDataParallel._get_active_ddp_module()
    if active is not None and any(sub is module for sub in active.module.modules()):
        raise ConfigurationError(
            f"{TECHNIQUE} was called on this module before DistributedDataParallel "
            "wrapped it, so it would step each parameter on its local gradient, before "
            "DDP averages it across ranks. Call it on the DDP model instead: "
            f"ddp = DistributedDataParallel(model); opt = {TECHNIQUE}(ddp, ...)."
        )


def _refuse_replaced_parameters(module: torch.nn.Module, args: Any,
                                anchors: list[tuple[str, torch.Tensor]]) -> None:
    """Forward pre-hook of a plain module stepped in backward: refuse to run once its
    parameters are not the ones the hooks were registered on.

    ``optimizer_in_backward(model)`` followed by ``fully_shard(model)`` (or anything
    else that replaces the parameter objects) leaves the step hooks on the old
    parameters: nothing would ever be stepped, without an error (measured: FSDP2 on 2
    gloo ranks trained nothing, ``step()`` a no-op). The first and last stepped
    parameters are looked up by name: two attribute walks per forward.
    """
    for name, param in anchors:
        try:
            current = module.get_parameter(name)
        except AttributeError:
            current = None
        if current is not param:
            raise ConfigurationError(
                f"the module's parameter {name!r} is no longer the one {TECHNIQUE} was "
                "set up on: something replaced the parameters afterwards (fully_shard, "
                "to_empty, a wrapper), so nothing would be stepped. Call "
                f"{TECHNIQUE} last, on the model you train: fully_shard(model); "
                f"opt = {TECHNIQUE}(model, ...)."
            )
