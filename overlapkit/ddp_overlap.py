"""DDP allreduce-then-step: :func:`overlap_ddp` and the optimizer it returns.

One DDP comm hook runs the chosen comm hook on each gradient bucket and, as soon as
that bucket's future completes, steps the optimizer on exactly that bucket's
parameters, while backward is still running for the other buckets. Everything is
resolved once here, at set-up: the overlapped implementation of the optimizer class
(registry, MRO) and the comm hook (registry, by name).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from overlapkit.errors import (
    ConfigurationError,
    PluginValidationError,
    UnsupportedModelError,
    UnsupportedOptimizerError,
)
from overlapkit.overlapped import OverlappedOptimizer
from overlapkit.plugins import get_plugin_manager

__all__ = ["STEP_THREADS", "DDPOverlapOptimizer", "overlap_ddp"]

_MARKER = "_overlapkit_overlap_ddp"
#: where bucket steps run: see overlap_ddp(step_thread=...)
STEP_THREADS = ("backward", "comm")


class _BucketStepper:
    """The state of the registered comm hook: runs the inner hook, then steps.

    ``step_thread="backward"``: a bucket whose reduction has completed is stepped on
    the thread running backward, at the next bucket's hook or, at the latest, just
    before DDP finalises backward. ``"comm"``: in the future's callback, which runs
    on a gloo worker thread concurrently with autograd (measured on torch 2.13).
    Either way the stepping goes through the engine's lock, and every bucket has
    been stepped when ``backward()`` returns.
    """

    def __init__(
        self,
        engine: OverlappedOptimizer,
        inner_state: Any,
        inner_hook: Any,
        *,
        track_usage: bool,
        step_thread: str,
        grads_are_bucket_views: bool,
        clip_grad_value: float | None,
        clip_grad_norm: float | None,
        clip_norm_type: float,
    ) -> None:
        self.engine = engine
        self.inner_state = inner_state
        self.inner_hook = inner_hook
        self.track_usage = track_usage
        self.step_thread = step_thread
        self.grads_are_bucket_views = grads_are_bucket_views
        self.clip_grad_value = clip_grad_value
        self.clip_grad_norm = clip_grad_norm
        self.clip_norm_type = clip_norm_type
        #: set on the autograd thread when a synchronised backward starts stepping
        self.stepped_since_step = False
        #: bucket index -> the owned parameters stepped with it, last backward
        self.last_buckets: dict[int, list[torch.Tensor]] = {}
        #: parameters that got a gradient on this rank since the last synced backward
        self.used: set[torch.Tensor] = set()
        self._in_backward = False
        self._pending: deque[tuple[dist.GradBucket, torch.futures.Future[Any]]] = deque()

    # -- on the autograd thread -------------------------------------------------

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if not self._in_backward:
            self._in_backward = True
            self.stepped_since_step = True
            # DDP queues its own finalize after the last bucket's hook; a callback
            # queued from ours (queued now, so it runs first) lands after it.
            Variable._execution_engine.queue_callback(self._before_finalize)
        future = self.inner_hook(self.inner_state, bucket)
        if self.step_thread == "comm":
            return future.then(lambda fut: self._step_bucket(bucket, fut))
        self._pending.append((bucket, future))
        self._drain(wait=False)
        return future

    def _drain(self, wait: bool) -> None:
        pending = self._pending
        while pending:
            bucket, future = pending[0]
            if not wait and not future.done():
                return
            pending.popleft()
            future.wait()
            self._step_bucket(bucket, future)

    def _before_finalize(self) -> None:
        self._drain(wait=True)
        Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._in_backward = False
        if not self.track_usage:
            return
        # find_unused_parameters: DDP knows which parameters were used on any rank
        # only in its finalize; the ones unused here were left for now and get
        # the gradient DDP finalised (None: unused everywhere, not stepped).
        unused = [
            p for p in self.engine.parameters() if p not in self.used
            and p.grad is not None
        ]
        self.used.clear()
        if unused:
            self._clip(unused)
            self.engine.step_params(unused)

    def note_used(self, param: torch.Tensor) -> None:
        self.used.add(param)

    # -- on a gloo worker thread ------------------------------------------------

    def _step_bucket(
        self, bucket: dist.GradBucket, future: torch.futures.Future[Any]
    ) -> torch.Tensor:
        result = future.value()
        if isinstance(result, (list, tuple)):
            result = result[0]
        buffer = bucket.buffer()
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result)
        engine = self.engine
        used = self.used
        track_usage = self.track_usage
        # gradient_as_bucket_view=True: DDP has made each used .grad a view of the
        # bucket. False: .grad is still the local gradient (DDP copies the reduced
        # one into it after backward), so the reduced view is lent for the step.
        lend = not self.grads_are_bucket_views
        chosen: list[torch.Tensor] = []
        restore: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            if not engine.owns(param) or (track_usage and param not in used):
                continue
            if lend:
                restore.append((param, param.grad))
                param.grad = grad
            chosen.append(param)
        self.last_buckets[bucket.index()] = chosen
        try:
            if chosen:
                self._clip(chosen)
                engine.step_params(chosen)
        finally:
            for param, local_grad in restore:
                param.grad = local_grad
        return buffer

    def _clip(self, params: list[torch.Tensor]) -> None:
        if self.clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.clip_grad_value)
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(
                params, self.clip_grad_norm, norm_type=self.clip_norm_type
            )


def _overlapped_comm_hook(state, bucket):  # type: ignore[no-untyped-def]
    # Left unannotated on purpose: DDP compares the annotation of `bucket` with
    # dist.GradBucket, and `from __future__ import annotations` makes it a string.
    return state.run(bucket)


class DDPOverlapOptimizer(torch.optim.Optimizer):
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
        engine: OverlappedOptimizer,
        stepper: _BucketStepper,
        model: DistributedDataParallel,
    ) -> None:
        # Optimizer.__init__ is not called: groups and state are the real optimizer's.
        self._engine = engine
        self._stepper = stepper
        self._model = model

    # -- the real optimizer's data, live ----------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The real ``optim_cls`` instance that steps the buckets."""
        return self._engine.optimizer

    @property
    def engine(self) -> OverlappedOptimizer:
        """The :class:`~overlapkit.OverlappedOptimizer` stepping the buckets."""
        return self._engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._engine.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        with self._engine.lock:
            self._engine.optimizer.param_groups = groups
            self._engine.reindex()

    @property
    def state(self) -> Any:
        return self._engine.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self._engine.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self._engine.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self._engine.optimizer.defaults = defaults

    # -- the Optimizer API ------------------------------------------------------

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Nothing to do after a synchronised backward: its buckets were stepped as
        their gradients arrived. Otherwise (no backward since the last ``step()``,
        or only ``no_sync()`` ones) an ordinary step of every parameter with a
        gradient, as the plain optimizer would take.

        :raises ConfigurationError: a closure was passed.
        """
        if closure is not None:
            raise ConfigurationError(
                "overlap_ddp steps during backward, so step() takes no closure; call "
                "loss.backward() yourself and then step() (or nothing)."
            )
        if self._stepper.stepped_since_step:
            self._stepper.stepped_since_step = False
            return
        self._engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._engine.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of parameters of the DDP model (validated like ``params``)."""
        _check_params_in_model(self._model, [param_group])
        self._engine.add_param_group(param_group)

    def register_step_pre_hook(self, hook: Any) -> Any:
        """Register on the real optimizer: runs before each bucket's step."""
        return self._engine.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> Any:
        """Register on the real optimizer: runs after each bucket's step."""
        return self._engine.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self._engine.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self._engine.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self._engine.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self._engine.optimizer.register_load_state_dict_post_hook(hook, prepend)

    # -- introspection ----------------------------------------------------------

    def last_buckets(self) -> list[list[torch.Tensor]]:
        """The owned parameters stepped together in each bucket of the last
        synchronised backward, in bucket order (DDP rebuilds its buckets after the
        first iteration). Norm clipping applies per entry."""
        buckets = self._stepper.last_buckets
        return [buckets[i] for i in sorted(buckets)]

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "a DDPOverlapOptimizer is bound to a live DDP model and cannot be pickled; "
            "save optimizer.state_dict() instead."
        )

    def __repr__(self) -> str:
        return f"DDPOverlapOptimizer({self._engine.optimizer!r})"


# -- set-up ------------------------------------------------------------------------


def _flatten_params(params: Iterable[Any]) -> list[Any]:
    flat: list[Any] = []
    for item in params:
        if isinstance(item, Mapping):
            inner = item.get("params", [])
            flat.extend([inner] if isinstance(inner, torch.Tensor) else list(inner))
        else:
            flat.append(item)
    return flat


def _check_params_in_model(model: DistributedDataParallel, params: Iterable[Any]) -> None:
    managed = {id(p) for p in DistributedDataParallel._get_data_parallel_params(model.module)
               if p.requires_grad}
    in_model = {id(p) for p in model.module.parameters()}
    for param in _flatten_params(params):
        if not isinstance(param, torch.Tensor):
            raise ConfigurationError(
                f"params must hold parameters of the DDP model (tensors or param-group "
                f"dicts), got {type(param).__name__}; pass e.g. ddp_model.parameters()."
            )
        if id(param) not in in_model:
            raise ConfigurationError(
                f"a parameter of shape {tuple(param.shape)} in params is not a parameter "
                "of the DDP model, so no bucket ever holds its gradient; pass only the "
                "model's parameters (ddp_model.parameters()), and step others with a "
                "plain optimizer."
            )
        if id(param) not in managed:
            raise ConfigurationError(
                f"a parameter of shape {tuple(param.shape)} in params is not managed by "
                "DDP (requires_grad=False, or in DDP's parameters to ignore), so it "
                "never gets a reduced gradient; leave it out of params."
            )


def _check_model(ddp_model: Any) -> DistributedDataParallel:
    if not isinstance(ddp_model, DistributedDataParallel):
        raise UnsupportedModelError(
            f"overlap_ddp needs a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}; wrap it first: DistributedDataParallel(model)."
        )
    if getattr(ddp_model, _MARKER, False):
        raise ConfigurationError(
            "overlap_ddp was already called on this DDP model, and a DDP model takes one "
            "comm hook; make one overlap_ddp call per model (pass params= to leave "
            "parameters to a plain optimizer stepped after backward)."
        )
    if getattr(ddp_model, "_comm_hooks", None):
        raise ConfigurationError(
            "this DDP model already has a comm hook registered, and a DDP model takes "
            "one; do not register it yourself: pass its name as overlap_ddp(..., "
            "comm_hook=NAME) and overlapkit runs it before stepping."
        )
    return ddp_model


def _check_clip(name: str, value: float | None) -> None:
    if value is not None and not (
        isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    ):
        raise ConfigurationError(
            f"{name} must be a positive finite number or None, got {value!r}."
        )


def overlap_ddp(
    ddp_model: DistributedDataParallel,
    optim_cls: type[torch.optim.Optimizer],
    *args: Any,
    params: Iterable[Any] | None = None,
    comm_hook: str = "allreduce",
    comm_hook_options: Mapping[str, Any] | None = None,
    step_thread: str = "backward",
    clip_grad_value: float | None = None,
    clip_grad_norm: float | None = None,
    clip_norm_type: float = 2.0,
    **optim_kwargs: Any,
) -> DDPOverlapOptimizer:
    """Step ``optim_cls`` on each DDP gradient bucket as soon as its comm hook
    completes, while backward still runs for the other buckets.

    Registers one comm hook on ``ddp_model``: the comm hook named ``comm_hook``
    (built with ``comm_hook_options``), then a step of exactly the bucket's
    parameters. Call it once per model, before training, on every rank.

    :param ddp_model: the ``DistributedDataParallel`` model.
    :param optim_cls: any ``torch.optim.Optimizer`` subclass; ``*args`` and
        ``**optim_kwargs`` are passed to it as to the plain optimizer.
    :param params: the parameters (or param-group dicts) to optimise; default: every
        parameter DDP manages. The others in a bucket are left alone, for another
        optimizer stepped after backward.
    :param comm_hook: a registered comm hook (``overlapkit plugins`` lists them).
    :param comm_hook_options: keyword options for the comm hook's builder.
    :param step_thread: ``"backward"`` (default): each bucket whose reduction has
        completed is stepped on the thread running backward, at the next bucket's
        hook or just before DDP finalises backward. ``"comm"``: in the comm future's
        callback, on the communication worker thread, concurrently with autograd
        (slower on CPU, where they compete for the same cores).
    :param clip_grad_value: clamp each gradient to ``[-v, v]`` before its step
        (exactly ``clip_grad_value_`` after backward).
    :param clip_grad_norm: clip the norm of each *bucket's* gradients to this value
        (per-bucket, not the global ``clip_grad_norm_``; see the docs).
    :param clip_norm_type: the norm of ``clip_grad_norm``.
    :return: a ``torch.optim.Optimizer``; its ``step()`` is a no-op after a backward
        that already stepped.
    :raises UnsupportedModelError: ``ddp_model`` is not DDP.
    :raises UnsupportedOptimizerError: ``optim_cls`` is not an optimizer class, or
        cannot step per bucket (LBFGS, SparseAdam).
    :raises UnknownNameError: no comm hook is called ``comm_hook``.
    :raises ConfigurationError: a second call on one model, a comm hook already
        registered, ``params`` not managed by the model, bad optimizer arguments.
    """
    model = _check_model(ddp_model)
    registry = get_plugin_manager().registry
    provider = registry.optimizer_provider(optim_cls)
    overlapped_cls = provider.record.overlapped_cls
    if not issubclass(overlapped_cls, OverlappedOptimizer):
        raise PluginValidationError(
            provider.plugin,
            f"its OptimizerSpec for {optim_cls.__qualname__} names {overlapped_cls!r}, "
            "which is not an overlapkit.OverlappedOptimizer subclass; subclass it.",
        )
    overlapped_cls.check_supported(optim_cls)
    hook_spec = registry.comm_hook(comm_hook)
    if comm_hook_options is not None and not isinstance(comm_hook_options, Mapping):
        raise ConfigurationError(
            f"comm_hook_options must be a dict of the hook's options, got "
            f"{type(comm_hook_options).__name__}."
        )
    if step_thread not in STEP_THREADS:
        raise ConfigurationError(
            f"step_thread must be one of {', '.join(map(repr, STEP_THREADS))}, got "
            f"{step_thread!r}."
        )
    _check_clip("clip_grad_value", clip_grad_value)
    _check_clip("clip_grad_norm", clip_grad_norm)

    if params is None:
        params = [p for p in DistributedDataParallel._get_data_parallel_params(model.module)
                  if p.requires_grad]
    else:
        params = list(params)
        _check_params_in_model(model, params)
    try:
        optimizer = optim_cls(params, *args, **optim_kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"{optim_cls.__qualname__} rejected the arguments overlap_ddp passed on: "
            f"{exc}. Fix the optimizer arguments (they are the plain optimizer's)."
        ) from exc
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"{optim_cls.__qualname__}(...) did not return a torch.optim.Optimizer; "
            "pass an optimizer class."
        )
    engine = overlapped_cls(optimizer)
    inner_state, inner_hook = hook_spec.build(
        process_group=model.process_group, **dict(comm_hook_options or {})
    )
    track_usage = bool(model.find_unused_parameters or model.static_graph)
    stepper = _BucketStepper(
        engine, inner_state, inner_hook, track_usage=track_usage, step_thread=step_thread,
        grads_are_bucket_views=bool(model.gradient_as_bucket_view),
        clip_grad_value=clip_grad_value, clip_grad_norm=clip_grad_norm,
        clip_norm_type=clip_norm_type,
    )
    if track_usage:
        for param in engine.parameters():
            param.register_post_accumulate_grad_hook(stepper.note_used)
    try:
        model.register_comm_hook(stepper, _overlapped_comm_hook)
    except RuntimeError as exc:
        raise ConfigurationError(
            f"DDP refused the comm hook: {exc}. A DDP model takes one comm hook; if you "
            "registered one (or a builtin one) yourself, remove it and pass its name as "
            "comm_hook=."
        ) from exc
    setattr(model, _MARKER, True)
    return DDPOverlapOptimizer(engine, stepper, model)
