"""The DDP set-up shared by ``overlap_ddp`` and ``optimizer_in_backward``, in the set-up
pass's three steps (:mod:`overlapkit.overlap.resolved`): resolve the DDP model and the
comm hook (:func:`resolve_on_ddp`), check what only a DDP model asks
(:func:`check_on_ddp`), then register one
:class:`~overlapkit.overlap.ddp.bucket_stepper.BucketStepper` comm hook
(:func:`set_up_on_ddp`).

Everything here runs once, at set-up, and every check before the one change.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from overlapkit.comm_hooks import allreduce_hook, reduce_bucket
from overlapkit.errors import ConfigurationError, UnsupportedModelError
from overlapkit.ft.refusals import refuse_torchft_ddp
from overlapkit.overlap.core.engine import OverlapEngine
from overlapkit.overlap.core.kept_graph import refusing_second_backwards
from overlapkit.overlap.core.own_hooks import OwnHook
from overlapkit.overlap.core.side_stream import SideStream
from overlapkit.overlap.ddp import comm_hook_guard
from overlapkit.overlap.ddp.bucket_stepper import BucketStepper
from overlapkit.overlap.ddp.join_divide import refuse_join_dividing_by_remaining_ranks
from overlapkit.overlap.ddp.kept_gradients import KeptGradientAveraging
from overlapkit.overlap.plain_step_guard import release_advice
from overlapkit.overlap.rebuild import before_forward_hook, check_takeover, plan_takeover, retire
from overlapkit.overlap.resolved import ModelFacts, ResolvedSetup, resolve_setup
from overlapkit.overlap.rules.clipping import GradClipping
from overlapkit.overlap.rules.global_step import step_rules
from overlapkit.overlap.setup import claim_params
from overlapkit.plugin.manager import get_plugin_manager

__all__ = ["CommHookSlot", "check_clipping_for_model", "check_comm_hook_options",
           "check_ddp_model", "check_on_ddp", "resolve_on_ddp", "set_up_on_ddp", "slot_comm_hook"]

# set on a DDP model to the CommHookSlot its registered comm hook runs
_MARKER = "_overlapkit_comm_hook_slot"


class CommHookSlot:
    """The state of the one comm hook overlapkit registers on a DDP model
    (:func:`slot_comm_hook`): it runs the model's current stepper, or, with none
    (``release()``), the comm hook that stepper reduced with, alone — what the model
    reduces with once nothing steps during backward.

    A DDP model takes one comm hook, and keeps it for good: a later ``overlap_ddp`` /
    ``optimizer_in_backward`` on the model binds its stepper here instead
    (:mod:`overlapkit.overlap.rebuild`).
    """

    def __init__(self) -> None:
        #: the stepper run for each bucket, or None
        self.stepper: BucketStepper | None = None
        #: the comm hook run without a stepper, as (state, hook)
        self.reduce: tuple[Any, Any] | None = None

    def bind(self, stepper: BucketStepper) -> None:
        """Run ``stepper`` from the next bucket on. It inherits what its predecessor
        learnt of DDP's rebuilt bucket layout (for checkpoints)."""
        previous = self.stepper
        if previous is not None and stepper.rebuilt_layout is None:
            stepper.rebuilt_layout = previous.rebuilt_layout
        self.stepper = stepper
        self.reduce = (stepper.inner_state, stepper.inner_hook)
        stepper.unbind = lambda: self._unbind(stepper)

    def _unbind(self, stepper: BucketStepper) -> None:
        if self.stepper is stepper:
            self.stepper = None

    def __reduce__(self) -> tuple[Any, ...]:
        # torch.save(ddp_model) / copy.deepcopy(ddp_model): DDP builds the copy a new
        # reducer without the comm hook, so the copy is a plain DDP model (as a copy of a
        # plainly trained one); its marker attribute reads as absent (None)
        return (_absent, ())


def _absent() -> None:
    return None


def _is_set_up(model: Any) -> bool:
    """Whether overlapkit registered its comm hook on the DDP ``model``."""
    return isinstance(getattr(model, _MARKER, None), CommHookSlot)


class _CommHooks(list[Any]):
    """DDP's ``_comm_hooks`` list on a model overlapkit set up: copied and pickled without
    overlapkit's entry, which the copy's new reducer does not run (DDP rebuilds it)."""

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (list, ([e for e in self if not isinstance(e[1], CommHookSlot)],))


def slot_comm_hook(state, bucket):  # type: ignore[no-untyped-def]
    """The function registered with ``register_comm_hook``; ``state`` is a
    :class:`CommHookSlot`."""
    # Left unannotated on purpose: DDP compares the annotation of `bucket` with
    # dist.GradBucket, and `from __future__ import annotations` makes it a string.
    stepper = state.stepper
    if stepper is not None:
        result = stepper.run(bucket)
    else:
        inner_state, inner_hook = state.reduce
        result = inner_hook(inner_state, bucket)
    if not isinstance(result, torch._C.Future):  # torch.futures.Future derives from it
        _refuse_hook_result(state, bucket, result)
    return result


def _refuse_hook_result(slot: CommHookSlot, bucket: Any, result: object) -> None:
    """A comm hook that returned no future (its tensor, None): refused naming it, in the
    bucket's first backward, nothing of it stepped (f2b92e2: torch's bare "Unable to
    cast Python instance of type <class 'torch.Tensor'> to C++ type '?'", as plain DDP)."""
    hook = (slot.stepper.inner_hook if slot.stepper is not None
            else slot.reduce[1] if slot.reduce else None)
    name = f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', hook)}"
    raise ConfigurationError(
        f"the comm hook {name} returned a {type(result).__name__} for gradient bucket "
        f"{bucket.index()}, not a torch.futures.Future; a comm hook returns the future of "
        "its reduction (e.g. dist.all_reduce(bucket.buffer(), async_op=True)"
        ".get_future().then(lambda f: f.value()[0])). Fix the hook (or its plugin).")


def reduce_hook_state(model: Any) -> Any:
    """The state of the comm hook (``comm_hook=``) overlapkit's hook on ``model``
    reduces with, or None (no overlapkit comm hook on it)."""
    slot = getattr(model, _MARKER, None)
    return slot.reduce[0] if isinstance(slot, CommHookSlot) and slot.reduce else None


def check_ddp_model(ddp_model: Any, technique: str) -> DistributedDataParallel:
    """:raises UnsupportedModelError: not DDP. :raises ConfigurationError: it already
    has a comm hook (overlapkit's or another)."""
    refuse_torchft_ddp(type(ddp_model), technique)  # torchft commits after backward
    if not isinstance(ddp_model, DistributedDataParallel):
        raise UnsupportedModelError(
            f"{technique} needs a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}; wrap it first: DistributedDataParallel(model)."
        )
    _refuse_sparse_gradients(ddp_model.module.named_modules(), technique)
    slot = getattr(ddp_model, _MARKER, None)
    if isinstance(slot, CommHookSlot):
        bound = slot.stepper
        if bound is not None and bound.technique != technique:
            raise ConfigurationError(
                f"{bound.technique} already steps this DDP model, and a DDP model takes "
                f"one comm hook, so {technique} cannot add its own; choose one of "
                "overlap_ddp and optimizer_in_backward per model, or call release() on "
                f"the {bound.technique} optimizer first."
                + release_advice(bound.technique, "ddp_model")
            )
        return ddp_model  # the slot's comm hook dispatches to the new stepper
    if getattr(ddp_model, "_comm_hooks", None):
        raise ConfigurationError(
            "this DDP model already has a comm hook registered, and a DDP model takes "
            f"one; do not register it yourself: pass its name as {technique}(..., "
            "comm_hook=NAME) and overlapkit runs it before stepping."
        )
    return ddp_model


def _refuse_sparse_gradients(modules: Iterable[tuple[str, torch.nn.Module]],
                             technique: str) -> None:
    """Refuse, at set-up, a module of ``modules`` (the DDP model's wrapped module's,
    named) that DDP reduces sparse gradients of (``nn.Embedding`` /
    ``nn.EmbeddingBag`` with ``sparse=True``, DDP's own test): DDP gives each its own
    bucket, the sparse gradient itself, which the comm hook cannot step as a bucket of
    dense views. 0.4.0 (``cdd1705``) failed at the end of the first backward with
    torch's bare "Cannot access data pointer of Tensor that doesn't have storage",
    the other buckets already stepped.

    :raises ConfigurationError: naming the first such module.
    """
    for name, module in modules:
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and \
                module.sparse and any(p.requires_grad for p in module.parameters()):
            raise ConfigurationError(
                f"{name or 'the model'} ({type(module).__name__}(sparse=True)) has sparse "
                f"gradients, which DDP reduces as a bucket of their own; {technique} "
                "steps each bucket's dense gradients during backward and cannot step "
                "those. Nothing was set up. Use sparse=False (dense gradients), or a plain "
                "optimizer on this model.")


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


def resolve_on_ddp(
    ddp_model: Any, optim: Any, args: tuple[Any, ...], optim_kwargs: dict[str, Any],
    params: Iterable[Any] | None, technique: str, *, comm_hook: str,
    comm_hook_options: Any, clipping: GradClipping, grad_scaler: Any | None,
    step_thread: str = "backward", policy: Any = None,
) -> ResolvedSetup:
    """Resolve a set-up on a DDP model: the model (:func:`check_ddp_model`), the comm
    hook by name and its options, then the optimizer side
    (:func:`~overlapkit.overlap.resolved.resolve_setup`)."""
    model = check_ddp_model(ddp_model, technique)
    facts = ModelFacts.of(model, "ddp", technique, inner=model.module)
    hook = get_plugin_manager().registry.comm_hook(comm_hook)
    return resolve_setup(facts, optim, args, optim_kwargs, params, clipping=clipping,
                         grad_scaler=grad_scaler, comm_hook=hook,
                         comm_hook_options=check_comm_hook_options(comm_hook_options),
                         step_thread=step_thread, policy=policy)


def check_on_ddp(setup: ResolvedSetup) -> None:
    """What only a set-up on a DDP model refuses, checked once: the clipping scope for
    the model (:func:`check_clipping_for_model`) and parameters another technique
    steps already."""
    model = setup.model.model
    assert isinstance(model, DistributedDataParallel)
    check_clipping_for_model(model, setup.clipping, setup.model.technique)
    slot = getattr(model, _MARKER, None)  # the stepper the model's comm hook runs now
    bound = slot.stepper if isinstance(slot, CommHookSlot) else None
    check_takeover(setup.stepped, setup.model.technique, lambda s: s is bound, also=bound)


def set_up_on_ddp(
    setup: ResolvedSetup,
    *,
    stepper_cls: type[BucketStepper] = BucketStepper,
    **stepper_options: Any,
) -> tuple[OverlapEngine, BucketStepper]:
    """Build what ``setup`` resolved on a DDP model (checked by :func:`check_on_ddp`):
    the engine, a side stream on the parameters' device, the rules of the step
    (clipping, a GradScaler), then the one change, the comm hook's registration running
    a ``stepper_cls`` (a :class:`~overlapkit.overlap.ddp.bucket_stepper.BucketStepper`,
    with ``stepper_options``); the parameters are claimed last."""
    model = setup.model.model
    assert isinstance(model, DistributedDataParallel) and setup.comm_hook is not None
    engine = setup.overlapped_cls(setup.optimizer)
    owned = engine.parameters()
    global_step, full_step = step_rules(setup.clipping, setup.grad_scaler,
                                        order=setup.model.order)
    inner_state, inner_hook = setup.comm_hook.create(process_group=model.process_group,
                                                     **setup.comm_hook_options)
    track_usage = bool(model.find_unused_parameters or model.static_graph)
    stepper = stepper_cls(
        engine, inner_state, inner_hook, track_usage=track_usage,
        grads_are_bucket_views=bool(model.gradient_as_bucket_view),
        technique=setup.model.technique, step_thread=setup.step_thread,
        clipping=setup.clipping, side_stream=SideStream(owned), global_step=global_step,
        full_step=full_step, static_graph=bool(model.static_graph), **stepper_options,
    )
    slot = getattr(model, _MARKER, None)
    if not isinstance(slot, CommHookSlot):
        slot = CommHookSlot()
        try:
            model.register_comm_hook(slot, slot_comm_hook)
        except RuntimeError as exc:
            raise ConfigurationError(
                f"DDP refused the comm hook: {str(exc).rstrip('.')}. A DDP model takes one "
                "comm hook; if you registered one (or a builtin one) yourself, remove it "
                "and pass its name as comm_hook=."
            ) from exc
        setattr(model, _MARKER, slot)
        model._comm_hooks = _CommHooks(model._comm_hooks)  # see _CommHooks
        comm_hook_guard.install(_is_set_up)  # a user's comm hook now: refused by name
    # the one change: the earlier optimizer on these parameters stops stepping
    bound = slot.stepper
    retire(plan_takeover(setup.stepped, setup.model.technique, lambda s: s is bound,
                         also=bound), setup.model.technique)
    slot.bind(stepper)
    # hooks on the parameters only once the comm hook is in (as below)
    averaging = KeptGradientAveraging.for_model(model) if inner_hook is allreduce_hook \
        else None
    if averaging is not None:  # 3, 6, 12 ... ranks and gradient_as_bucket_view=True
        stepper.average = averaging.average
        stepper.inner_hook = partial(reduce_bucket, average=averaging.average)
    # held weakly: the model holds the stepper (its comm hook's state) in C++, where
    # Python's collector cannot see the cycle; a strong reference kept every model
    # dropped within its first step, and its optimizer, alive for good (issue 31 probe)
    stepper.model_before_rebuild = weakref.ref(model)
    # DDP lays its buckets out again after the first backward, except where it tracks
    # parameter usage; checkpoints record that second layout (checkpoint.ddp_buckets)
    stepper.recording_layout = not track_usage
    # Only now that the comm hook is in: hooks left on the parameters after a refused
    # registration would keep freeing gradients nobody steps.
    if stepper.free_grads and not model.gradient_as_bucket_view:
        stepper.free_after_copy_model = weakref.ref(model)
        stepper.unreduced.active = True
        stepper.handles.append(model.register_forward_pre_hook(
            OwnHook(stepper.unreduced.forward_through_ddp)))
    stepper.register(owned)
    names = setup.model.names
    stepper.frozen = [(names[id(p)], p) for p in owned if id(p) not in setup.model.reduced]
    # always: a backward that raised leaves the stepper's scope open (before_forward)
    stepper.handles.append(
        model.register_forward_pre_hook(OwnHook(before_forward_hook, stepper)))
    stepper.handles.append(model.register_forward_hook(refusing_second_backwards(stepper)))
    if inner_hook is allreduce_hook:  # a comm hook of the user's: plain DDP ignores it too
        stepper.handles.append(model.register_forward_pre_hook(OwnHook(
            refuse_join_dividing_by_remaining_ranks, setup.model.technique), prepend=True))
    claim_params(owned, setup.model.technique)
    return engine, stepper
