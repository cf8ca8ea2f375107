"""The two public calls, :func:`overlap_ddp` and :func:`optimizer_in_backward`: each
takes the set-up pass (:mod:`overlapkit.overlap.resolved`: resolve, check, build) down
the path its model and options choose — the DDP path (:mod:`overlapkit.overlap.ddp`),
sharded state on it (:mod:`overlapkit.overlap.sharded`), or the in-backward path on a
plain or FSDP2 module (:mod:`overlapkit.overlap.in_backward`). The choice between the
paths is made here and only here, so no path imports another path's caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.ddp.bucket_stepper import STEP_THREADS
from overlapkit.overlap.ddp.optimizer import TECHNIQUE as OVERLAP_DDP
from overlapkit.overlap.ddp.optimizer import DDPOverlapOptimizer
from overlapkit.overlap.ddp.setup import check_on_ddp, resolve_on_ddp, set_up_on_ddp
from overlapkit.overlap.in_backward.optimizer import TECHNIQUE as IN_BACKWARD
from overlapkit.overlap.in_backward.optimizer import OptimizerInBackward
from overlapkit.overlap.in_backward.setup import model_kind, replaceable, set_up_on_module
from overlapkit.overlap.rebuild import check_takeover, mark_when_dropped, orphan_when_dropped
from overlapkit.overlap.resolved import ModelFacts, resolve_setup
from overlapkit.overlap.rules.clipping import GradClipping
from overlapkit.overlap.sharded.optimizer import ShardedOverlapOptimizer
from overlapkit.overlap.sharded.setup import resolve_policy, shard_on_ddp

__all__ = ["optimizer_in_backward", "overlap_ddp"]


def overlap_ddp(
    ddp_model: DistributedDataParallel,
    optim_cls: type[torch.optim.Optimizer] | torch.optim.Optimizer,
    *args: Any,
    params: Iterable[Any] | None = None,
    comm_hook: str = "allreduce",
    comm_hook_options: Mapping[str, Any] | None = None,
    step_thread: str = "backward",
    clip_grad_value: float | None = None,
    clip_grad_norm: float | None = None,
    clip_norm_type: float = 2.0,
    clip_grad_norm_scope: str = "global",
    grad_scaler: Any | None = None,
    shard_optimizer_state: Any = False,
    **optim_kwargs: Any,
) -> DDPOverlapOptimizer | ShardedOverlapOptimizer:
    """Step ``optim_cls`` on each DDP gradient bucket as soon as its comm hook
    completes, while the other buckets still run backward or reduce (on CPU, from the
    end of backward's computation: see ``step_thread``).

    Registers one comm hook on ``ddp_model``: the comm hook named ``comm_hook``
    (built with ``comm_hook_options``), then a step of exactly the bucket's
    parameters. Call it once per model, before training, on every rank.

    :param ddp_model: the ``DistributedDataParallel`` model.
    :param optim_cls: any ``torch.optim.Optimizer`` subclass; ``*args`` and
        ``**optim_kwargs`` are passed to it as to the plain optimizer. Or an existing
        optimizer instance over the model's parameters, adopted as it is (its param
        groups, state and LR schedulers; the returned optimizer steps it): then no
        ``*args``, ``params`` or optimizer keyword arguments (see
        :mod:`overlapkit.overlap.adopt`).
    :param params: the parameters (or param-group dicts) to optimise; default: every
        parameter DDP manages. The others in a bucket are left alone, for another
        optimizer stepped after backward. Frozen parameters are accepted (never
        stepped, no state), as torch's optimizers accept them.
    :param comm_hook: a registered comm hook (``overlapkit plugins`` lists them).
    :param comm_hook_options: keyword options for the comm hook's builder.
    :param step_thread: ``"backward"`` (default): buckets whose reduction has
        completed are stepped on the thread running backward: on an accelerator at
        the next bucket's hook (the step runs on a side stream beside backward); on
        CPU once backward's computation is done, the buckets reduced by then in one
        call, the others as their reductions complete, or all of them once every
        reduction has: the first where the waits are idle (a network) or the
        buckets big, the second for small buckets reduced over loopback
        (:mod:`overlapkit.overlap.ddp.inline_schedule`). ``"comm"``: in the comm
        future's callback, on the communication worker thread, concurrently with
        autograd (slower on CPU, where they compete for the same cores).
    :param clip_grad_value: clamp each gradient to ``[-v, v]`` before its step
        (exactly ``clip_grad_value_`` after backward).
    :param clip_grad_norm: clip the gradients' norm to this value: by default
        exactly ``torch.nn.utils.clip_grad_norm_`` over every gradient the optimizer
        steps, before the step (the steps then wait for the end of backward; the
        allreduces still overlap it).
    :param clip_norm_type: the norm of ``clip_grad_norm``.
    :param clip_grad_norm_scope: ``"global"`` (default, as above) or ``"bucket"``:
        each bucket's gradients clipped by their own norm and stepped as soon as the
        bucket is reduced (0.1's behaviour; refused with ``find_unused_parameters``
        or ``static_graph``).
    :param grad_scaler: the ``torch.amp.GradScaler`` of an fp16 AMP loop
        (``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``): the
        gradients are unscaled and checked for infs as ``scaler.step`` would, and all
        steps skipped when any rank overflowed — bitwise plain DDP with the scaler. The
        steps wait for the end of backward.
    :param shard_optimizer_state: ``True``: each rank keeps the optimizer state of, and
        steps, only its share of the parameters (whole parameters, balanced by size),
        and sends the updated ones to the other ranks while backward goes on (ZeRO-1);
        or a :class:`~overlapkit.ShardingPolicy` deciding the shares. Bitwise the same
        training; see ``docs/sharded_state.rst``.
    :return: a ``torch.optim.Optimizer``; its ``step()`` is a no-op after a backward
        that already stepped (a :class:`~overlapkit.ShardedOverlapOptimizer` with
        ``shard_optimizer_state``).
    :raises UnsupportedModelError: ``ddp_model`` is not DDP.
    :raises UnsupportedOptimizerError: ``optim_cls`` is not an optimizer class, or
        cannot step per bucket (LBFGS, SparseAdam).
    :raises UnknownNameError: no comm hook is called ``comm_hook``.
    :raises ConfigurationError: a second call over part of a live optimizer's
        parameters (over all of them it replaces it: :mod:`overlapkit.overlap.rebuild`),
        a comm hook already registered, ``params`` not managed by the model, bad
        optimizer arguments,
        ``clip_grad_norm_scope="bucket"`` on a model with ``find_unused_parameters`` or
        ``static_graph``; with ``shard_optimizer_state``: ``step_thread="comm"``,
        ``find_unused_parameters``, a policy that answers badly or differently on
        different ranks.
    :raises UnsupportedOptimizerError: with ``shard_optimizer_state``, an optimizer
        whose step couples parameters (state not per parameter, values written into its
        param groups).
    """
    if step_thread not in STEP_THREADS:
        raise ConfigurationError(
            f"step_thread must be one of {', '.join(map(repr, STEP_THREADS))}, got "
            f"{step_thread!r}."
        )
    clipping = GradClipping(value=clip_grad_value, norm=clip_grad_norm,
                            norm_type=clip_norm_type, scope=clip_grad_norm_scope)
    setup = resolve_on_ddp(
        ddp_model, optim_cls, args, optim_kwargs, params, OVERLAP_DDP, comm_hook=comm_hook,
        comm_hook_options=comm_hook_options, clipping=clipping, grad_scaler=grad_scaler,
        step_thread=step_thread, policy=resolve_policy(shard_optimizer_state))
    check_on_ddp(setup)
    if setup.policy is not None:
        return mark_when_dropped(shard_on_ddp(setup))
    engine, stepper = set_up_on_ddp(setup)
    assert setup.comm_hook is not None  # resolve_on_ddp resolved it
    return mark_when_dropped(DDPOverlapOptimizer(engine, stepper, setup.model,
                                                 setup.comm_hook.name))


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
    :raises ConfigurationError: no trainable parameters, a second call over part of a
        live optimizer's parameters (all of them: it replaces it), mixing with
        ``overlap_ddp``, ``params`` not in the model, a comm hook for a model that is
        not DDP, bad optimizer or clipping arguments,
        ``clip_grad_norm_scope="bucket"`` on a DDP model with
        ``find_unused_parameters`` or ``static_graph``.
    """
    kind = model_kind(module)
    clipping = GradClipping(value=clip_grad_value, norm=clip_grad_norm,
                            norm_type=clip_norm_type, scope=clip_grad_norm_scope)
    if kind == "ddp":
        setup = resolve_on_ddp(module, optim_cls, args, optim_kwargs, params, IN_BACKWARD,
                               comm_hook=comm_hook or "allreduce",
                               comm_hook_options=comm_hook_options, clipping=clipping,
                               grad_scaler=grad_scaler)
        check_on_ddp(setup)
        engine, stepper = set_up_on_ddp(setup, free_grads=True)
        optimizer = OptimizerInBackward(engine, stepper, setup.model)
        assert setup.comm_hook is not None  # resolve_on_ddp resolved it
        optimizer._hook_name = setup.comm_hook.name  # for CommHookStateFacade's messages
        return mark_when_dropped(optimizer)
    if comm_hook is not None or comm_hook_options is not None:
        raise ConfigurationError(
            f"comm_hook applies to DistributedDataParallel models only, and this is "
            f"{'an FSDP2' if kind == 'fsdp2' else 'a plain'} module; leave comm_hook and "
            "comm_hook_options out."
        )
    setup = resolve_setup(ModelFacts.of(module, kind, IN_BACKWARD), optim_cls, args,
                          optim_kwargs, params, clipping=clipping, grad_scaler=grad_scaler)
    check_takeover(setup.stepped, IN_BACKWARD, replaceable)
    optimizer = set_up_on_module(setup)
    # one process's: a DDP or FSDP2 model's ranks would not collect it at once
    optimizer = mark_when_dropped(optimizer)
    return orphan_when_dropped(optimizer) if kind == "module" else optimizer
