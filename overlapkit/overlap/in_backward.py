"""Optimizer in backward: :func:`optimizer_in_backward` and the optimizer it returns.

The optimizer steps each part of the model during backward, as soon as that part's
gradient is final, and frees the gradient, so the gradients of the whole model never
exist at once. One real optimizer instance takes every step (through the
:class:`~overlapkit.OverlapEngine` engine registered for its class), so the
returned object is a ``torch.optim.Optimizer``: LR schedulers, ``state_dict()`` and
checkpoints work as with the plain optimizer. Three kinds of model:

- a DDP model: a comm hook steps each bucket once its reduction completes
  (:mod:`overlapkit.overlap.bucket_stepper`);
- an FSDP2 (``fully_shard``) model or a plain module: a post-accumulate-grad hook per
  parameter (:mod:`overlapkit.overlap.param_stepper`).

On an accelerator the steps run on a side stream (:mod:`overlapkit.overlap.side_stream`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from overlapkit.errors import ConfigurationError, UnsupportedModelError
from overlapkit.overlap.clipping import GradClipping
from overlapkit.overlap.ddp_setup import check_on_ddp, resolve_on_ddp, set_up_on_ddp
from overlapkit.overlap.engine import OverlapEngine
from overlapkit.overlap.facade import BackwardSteps, OverlappedOptimizerFacade
from overlapkit.overlap.global_step import step_rules
from overlapkit.overlap.param_stepper import ParamStepper
from overlapkit.overlap.resolved import MODEL_KINDS, ModelFacts, ResolvedSetup, resolve_setup
from overlapkit.overlap.setup import check_unclaimed, claim_params
from overlapkit.overlap.side_stream import SideStream

__all__ = ["MODEL_KINDS", "OptimizerInBackward", "optimizer_in_backward"]

TECHNIQUE = "optimizer_in_backward"


class OptimizerInBackward(OverlappedOptimizerFacade):
    """The optimizer :func:`optimizer_in_backward` returns: a ``torch.optim.Optimizer``
    whose steps happen during backward, after which the gradients are None.

    ``param_groups``, ``state``, ``defaults``, ``state_dict()`` and
    ``load_state_dict()`` are those of the real optimizer inside (see
    :attr:`optimizer`); :meth:`step` is a no-op after a backward that stepped.
    """

    def __init__(
        self,
        engine: OverlapEngine,
        steps: BackwardSteps,
        model: ModelFacts,
    ) -> None:
        super().__init__(engine, steps, TECHNIQUE, model.check_params_now)
        self._model = model.model
        #: ``"ddp"``, ``"fsdp2"`` or ``"module"``: how the steps are hooked in
        self.kind = model.kind

    @contextmanager
    def no_step(self) -> Iterator[None]:
        """Backwards inside accumulate gradients and step nothing; the next backward
        outside steps the accumulated gradients (then frees them), as the plain
        optimizer's ``step()`` after accumulation would. For a DDP model this is
        ``ddp_model.no_sync()``."""
        if isinstance(self._steps, ParamStepper):
            stepper = self._steps
            stepper.paused = True
            try:
                yield
            finally:
                stepper.paused = False
        else:
            assert isinstance(self._model, DistributedDataParallel)
            with self._model.no_sync():
                yield


# -- set-up ------------------------------------------------------------------------


def _model_kind(module: Any) -> str:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(module, DistributedDataParallel):
        return "ddp"
    if not isinstance(module, torch.nn.Module):
        raise UnsupportedModelError(
            f"{TECHNIQUE} needs a torch.nn.Module (plain, DistributedDataParallel or "
            f"fully_shard), got {type(module).__name__}."
        )
    kind = "module"
    for sub in module.modules():
        if isinstance(sub, FullyShardedDataParallel):
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
        if isinstance(sub, FSDPModule):
            kind = "fsdp2"
    return kind


def optimizer_in_backward(
    module: torch.nn.Module,
    optim_cls: type[torch.optim.Optimizer] | torch.optim.Optimizer,
    *args: Any,
    params: Iterable[Any] | None = None,
    comm_hook: str | None = None,
    comm_hook_options: Mapping[str, Any] | None = None,
    clip_grad_value: float | None = None,
    clip_grad_norm: float | None = None,
    clip_norm_type: float = 2.0,
    clip_grad_norm_scope: str = "global",
    grad_scaler: Any | None = None,
    **optim_kwargs: Any,
) -> OptimizerInBackward:
    """Step ``optim_cls`` during backward, part by part as gradients become final, and
    free each gradient once stepped.

    - ``module`` is a ``DistributedDataParallel`` model: one comm hook runs the comm
      hook named ``comm_hook`` (default ``"allreduce"``) on each bucket, then steps the
      bucket's parameters; their ``.grad`` are None once backward returns.
    - ``module`` is an FSDP2 (``fully_shard``) model or a plain module: each parameter
      is stepped, and its ``.grad`` set to None, as soon as its gradient is final (for
      FSDP2: reduce-scattered, the sharded parameter and gradient).

    On an accelerator the steps run on a side stream the current stream waits for at
    the end of backward; on CPU inline. Call it once per model, before training, on
    every rank.

    :param module: a DDP model, an FSDP2 model, or a plain ``torch.nn.Module``.
    :param optim_cls: any ``torch.optim.Optimizer`` subclass; ``*args`` and
        ``**optim_kwargs`` are passed to it as to the plain optimizer. Or an existing
        optimizer instance over the model's parameters, adopted as it is (its param
        groups, state and LR schedulers; the returned optimizer steps it): then no
        ``*args``, ``params`` or optimizer keyword arguments (see
        :mod:`overlapkit.overlap.adopt`).
    :param params: the parameters (or param-group dicts) to optimise; default: every
        trainable parameter (for DDP: every parameter DDP manages). Others keep
        their gradients, for another optimizer stepped after backward. Frozen
        parameters are accepted (never stepped, no state), as torch's optimizers
        accept them; one unfrozen later is stepped from the next forward's backward on
        (plain module, FSDP2) or refused at that forward (DDP).
    :param comm_hook: DDP only: a registered comm hook, run before each bucket's step.
    :param comm_hook_options: DDP only: keyword options for the comm hook's builder.
    :param clip_grad_value: clamp each gradient to ``[-v, v]`` before its step
        (exactly ``clip_grad_value_`` after backward).
    :param clip_grad_norm: clip the gradients' norm to this value: by default
        exactly ``torch.nn.utils.clip_grad_norm_`` over every gradient the optimizer
        steps, before the step. That needs every gradient at once: the steps wait for
        the end of backward and the gradients are freed after them (the memory saving
        of freeing them during backward is lost).
    :param clip_norm_type: the norm of ``clip_grad_norm``.
    :param clip_grad_norm_scope: ``"global"`` (default, as above) or ``"bucket"``:
        each bucket's (DDP) or parameter's (FSDP2, plain) gradient clipped by its own
        norm and stepped at once (0.1's behaviour; refused for a DDP model with
        ``find_unused_parameters`` or ``static_graph``).
    :param grad_scaler: the ``torch.amp.GradScaler`` of an fp16 AMP loop (DDP, FSDP2
        and plain modules): unscaled and inf-checked as ``scaler.step`` would, all
        steps skipped on an overflow (FSDP2: on any rank's shard, as
        ``ShardedGradScaler``); the steps wait for the end of backward.
    :return: a ``torch.optim.Optimizer``; its ``step()`` is a no-op after a backward
        that already stepped.
    :raises UnsupportedModelError: not a module, or an FSDP1 model.
    :raises UnsupportedOptimizerError: ``optim_cls`` is not an optimizer class, or
        cannot step part by part (LBFGS, SparseAdam).
    :raises UnknownNameError: no comm hook is called ``comm_hook``.
    :raises ConfigurationError: no trainable parameters, a second call for the same
        parameters, mixing with ``overlap_ddp``, ``params`` not in the model, a comm
        hook for a model that is not DDP, bad optimizer or clipping arguments,
        ``clip_grad_norm_scope="bucket"`` on a DDP model with
        ``find_unused_parameters`` or ``static_graph``.
    """
    kind = _model_kind(module)
    clipping = GradClipping(value=clip_grad_value, norm=clip_grad_norm,
                            norm_type=clip_norm_type, scope=clip_grad_norm_scope)
    if kind == "ddp":
        setup = resolve_on_ddp(module, optim_cls, args, optim_kwargs, params, TECHNIQUE,
                               comm_hook=comm_hook or "allreduce",
                               comm_hook_options=comm_hook_options, clipping=clipping,
                               grad_scaler=grad_scaler)
        check_on_ddp(setup)
        engine, stepper = set_up_on_ddp(setup, free_grads=True)
        return OptimizerInBackward(engine, stepper, setup.model)
    if comm_hook is not None or comm_hook_options is not None:
        raise ConfigurationError(
            f"comm_hook applies to DistributedDataParallel models only, and this is "
            f"{'an FSDP2' if kind == 'fsdp2' else 'a plain'} module; leave comm_hook and "
            "comm_hook_options out."
        )
    setup = resolve_setup(ModelFacts.of(module, kind, TECHNIQUE), optim_cls, args,
                          optim_kwargs, params, clipping=clipping, grad_scaler=grad_scaler)
    check_unclaimed(setup.stepped, TECHNIQUE)
    return _set_up_on_module(setup)


def _set_up_on_module(setup: ResolvedSetup) -> OptimizerInBackward:
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
    stepper.register(owned)
    if setup.model.kind == "module":
        stepper.handles.append(module.register_forward_pre_hook(_refuse_inside_ddp))
        names = setup.model.names
        anchors = [(names[id(p)], p) for p in (owned[0], owned[-1])]
        stepper.handles.append(module.register_forward_pre_hook(
            lambda module, args: _refuse_replaced_parameters(module, anchors)))
    if stepper.frozen:
        # a frozen parameter unfrozen later is hooked before the forward that builds
        # the graph its gradient comes from: stepped from that backward on
        stepper.handles.append(module.register_forward_pre_hook(
            lambda module, args: stepper.hook_unfrozen()))
    if stepper.side_stream.active:
        # the next forward (FSDP2: its all-gather) reads the parameters: join a
        # backward that raised, whose end-of-backward join did not run
        stepper.handles.append(module.register_forward_pre_hook(
            lambda module, args: stepper.synchronize()))
    claim_params(owned, TECHNIQUE)
    return OptimizerInBackward(engine, stepper, setup.model)


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


def _refuse_replaced_parameters(module: torch.nn.Module,
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
