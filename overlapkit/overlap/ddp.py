"""DDP allreduce-then-step: :func:`overlap_ddp` and the optimizer it returns.

One DDP comm hook runs the chosen comm hook on each gradient bucket and, as soon as
that bucket's future completes, steps the optimizer on exactly that bucket's
parameters, while backward is still running for the other buckets. Everything is
resolved once here, at set-up: the overlapped implementation of the optimizer class
(registry, MRO) and the comm hook (registry, by name). The comm hook itself lives in
:mod:`overlapkit.overlap.bucket_stepper`, the returned optimizer's behaviour in
:mod:`overlapkit.overlap.facade`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.bucket_stepper import STEP_THREADS, BucketStepper
from overlapkit.overlap.clipping import GradClipping
from overlapkit.overlap.ddp_setup import check_on_ddp, resolve_on_ddp, set_up_on_ddp
from overlapkit.overlap.engine import OverlapEngine
from overlapkit.overlap.facade import OverlappedOptimizerFacade
from overlapkit.overlap.resolved import ModelFacts
from overlapkit.overlap.sharded.optimizer import ShardedOverlapOptimizer
from overlapkit.overlap.sharded.setup import resolve_policy, shard_on_ddp

__all__ = ["STEP_THREADS", "DDPOverlapOptimizer", "overlap_ddp"]

TECHNIQUE = "overlap_ddp"


class DDPOverlapOptimizer(OverlappedOptimizerFacade):
    """The optimizer :func:`overlap_ddp` returns: a ``torch.optim.Optimizer`` whose
    steps happen during backward, one DDP bucket at a time.

    ``param_groups``, ``state``, ``defaults``, ``state_dict()`` and
    ``load_state_dict()`` are those of the real optimizer inside (see
    :attr:`optimizer`), so LR schedulers drive it and checkpoints load into a plain
    optimizer of the same class and back. :meth:`step` is a no-op after a backward
    that already stepped.
    """

    def __init__(
        self,
        engine: OverlapEngine,
        stepper: BucketStepper,
        model: ModelFacts,
    ) -> None:
        super().__init__(engine, stepper, TECHNIQUE, model.check_params_now)
        self._stepper = stepper
        self._model = model.model

    def last_buckets(self) -> list[list[torch.Tensor]]:
        """The owned parameters stepped together in each bucket of the last
        synchronised backward, in bucket order (DDP rebuilds its buckets after the
        first iteration). Norm clipping applies per entry."""
        buckets = self._stepper.last_buckets
        return [list(buckets[i]) for i in sorted(buckets)]


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
    completes, while backward still runs for the other buckets.

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
    :param step_thread: ``"backward"`` (default): each bucket whose reduction has
        completed is stepped on the thread running backward, at the next bucket's
        hook or just before DDP finalises backward. ``"comm"``: in the comm future's
        callback, on the communication worker thread, concurrently with autograd
        (slower on CPU, where they compete for the same cores).
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
    :raises ConfigurationError: a second call on one model, a comm hook already
        registered, ``params`` not managed by the model, bad optimizer arguments,
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
        ddp_model, optim_cls, args, optim_kwargs, params, TECHNIQUE, comm_hook=comm_hook,
        comm_hook_options=comm_hook_options, clipping=clipping, grad_scaler=grad_scaler,
        step_thread=step_thread, policy=resolve_policy(shard_optimizer_state))
    check_on_ddp(setup)
    if setup.policy is not None:
        return shard_on_ddp(setup)
    engine, stepper = set_up_on_ddp(setup)
    return DDPOverlapOptimizer(engine, stepper, setup.model)
