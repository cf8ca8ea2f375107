"""The set-up of sharded optimizer state on a DDP model: every check, the ownership,
then ``overlap_ddp``'s own set-up with the sharded stepper, this rank's share and the
parameter exchange.

Everything that can be refused is refused before the comm hook is registered: the
options sharding cannot honour (``step_thread="comm"``, ``find_unused_parameters``), an
optimizer whose step couples parameters, a sharding policy that answers badly or
differently on different ranks.

.. versionadded:: 0.3
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from overlapkit.errors import ConfigurationError, UnsupportedOptimizerError
from overlapkit.overlap.core.step_hooks import sharded_override_refusal, step_override
from overlapkit.overlap.ddp.setup import set_up_on_ddp
from overlapkit.overlap.resolved import ResolvedSetup
from overlapkit.overlap.rules.clipping import GradClipping
from overlapkit.overlap.sharded.exchange import ParameterExchange, exchange_group
from overlapkit.overlap.sharded.optimizer import ShardedOverlapOptimizer
from overlapkit.overlap.sharded.ownership import (
    Ownership,
    ShardingPolicy,
    SizeBalancedPolicy,
    assign_owners_agreed,
    drop_state_outside_share,
    slots_of,
)
from overlapkit.overlap.sharded.stepper import ShardedBucketStepper

__all__ = ["check_shardable", "resolve_policy", "shard_on_ddp", "wait_before_module_forward"]


def resolve_policy(shard_optimizer_state: Any) -> ShardingPolicy | None:
    """The policy ``shard_optimizer_state`` asks for: None (not sharded) for False,
    :class:`SizeBalancedPolicy` for True, or the :class:`ShardingPolicy` given.

    :raises ConfigurationError: anything else.
    """
    if shard_optimizer_state is False or shard_optimizer_state is None:
        return None
    if shard_optimizer_state is True:
        return SizeBalancedPolicy()
    if isinstance(shard_optimizer_state, ShardingPolicy):
        return shard_optimizer_state
    if isinstance(shard_optimizer_state, type) and issubclass(shard_optimizer_state,
                                                             ShardingPolicy):
        got = (f"the class {shard_optimizer_state.__qualname__} (pass an instance: "
               f"{shard_optimizer_state.__name__}())")
    else:
        got = repr(shard_optimizer_state)
    raise ConfigurationError(
        "shard_optimizer_state must be True, False or a "
        f"overlapkit.ShardingPolicy instance, got {got}."
    )


def _twins(params: Sequence[Any]) -> list[Any]:
    """``params`` (tensors or group dicts) with every parameter replaced by a meta twin
    (same shape and dtype, no memory) holding a zero gradient."""
    def twin(param: torch.Tensor) -> torch.Tensor:
        copy = torch.empty_like(param, device="meta")
        if param.requires_grad:
            copy.requires_grad_(True)
            copy.grad = torch.zeros_like(copy)
        return copy

    out: list[Any] = []
    for item in params:
        if isinstance(item, Mapping):
            inner = item["params"]
            inner = [inner] if isinstance(inner, torch.Tensor) else list(inner)
            out.append({**item, "params": [twin(p) for p in inner]})
        else:
            out.append(twin(item))
    return out


def check_shardable(optim_cls: type[torch.optim.Optimizer], args: Sequence[Any],
                    optim_kwargs: Mapping[str, Any], params: Sequence[Any]) -> None:
    """Refuse an optimizer whose step couples parameters, which a rank stepping only
    its share would compute differently from the plain optimizer.

    One step of a throwaway instance over meta-device twins of the parameters (no
    memory, nothing computed, the real optimizer untouched) shows what the step keeps:
    state under keys that are not parameters, or values written into the param groups
    (D-Adaptation's and Prodigy's ``d``, computed from all parameters), are such
    coupling. An optimizer that cannot be built or stepped on meta tensors is let
    through (its own errors come at the real set-up and step).

    A class overriding the ``step()`` of the one it derives from is refused too: each
    rank would run the override on its share only, per part stepped
    (:func:`~overlapkit.overlap.core.step_hooks.step_override`), where overlap_ddp
    without sharding takes the plain order for it.

    :raises UnsupportedOptimizerError: naming what couples the parameters.
    """
    try:
        optimizer = optim_cls(_twins(params), *args, **optim_kwargs)
        before = [dict(group) for group in optimizer.param_groups]
        optimizer.step()
    except Exception:  # not decidable here: the real set-up and step will tell
        _refuse_override(optim_cls)
        return
    twins = {id(p) for group in optimizer.param_groups for p in group["params"]}
    foreign = [key for key in optimizer.state if id(key) not in twins]
    if foreign:
        raise UnsupportedOptimizerError(
            f"{optim_cls.__qualname__} keeps optimizer state that belongs to no single "
            f"parameter ({len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} keyed "
            "by something else), so it cannot be sharded by parameter: each rank would "
            "keep its own copy, computed from its share. Use overlap_ddp without "
            "shard_optimizer_state, or an optimizer whose state is per parameter."
        )
    for index, (group, old) in enumerate(zip(optimizer.param_groups, before, strict=True)):
        changed = sorted(key for key, value in group.items()
                         if key != "params" and (key not in old or old[key] is not value))
        if changed:
            raise UnsupportedOptimizerError(
                f"{optim_cls.__qualname__} writes {', '.join(map(repr, changed))} into "
                f"param group {index} during step(): a value computed from every "
                "parameter of the group (as D-Adaptation's and Prodigy's 'd'), which a "
                "rank stepping only its share would compute differently. Use overlap_ddp "
                "without shard_optimizer_state for this optimizer."
            )
    _refuse_override(optim_cls)


def _refuse_override(optim: type[torch.optim.Optimizer] | torch.optim.Optimizer) -> None:
    """:raises UnsupportedOptimizerError: ``optim`` (a class, or an adopted instance)
    overrides the ``step()`` of the class it derives from, or has ``step`` patched on the
    instance (see :func:`check_shardable`)."""
    override = step_override(optim)
    if override is not None:
        raise sharded_override_refusal(override)


def _refuse_options(step_thread: str, clipping: GradClipping, *,
                    find_unused_parameters: bool) -> None:
    """:raises ConfigurationError: options sharded optimizer state cannot honour."""
    if clipping.norm is not None and clipping.scope == "bucket":
        raise ConfigurationError(
            "clip_grad_norm_scope='bucket' cannot be used with shard_optimizer_state: "
            "each rank steps only its share of a bucket, so the norm of what it steps "
            "would be its share's, and the result would change with the number of "
            "ranks. Use the default clip_grad_norm_scope='global' (exact: "
            "torch.nn.utils.clip_grad_norm_ over every gradient), clip_grad_value, or "
            "overlap_ddp without shard_optimizer_state."
        )
    if step_thread != "backward":
        raise ConfigurationError(
            f"step_thread={step_thread!r} cannot be used with shard_optimizer_state: the "
            "updated parameters are sent to the other ranks right after each bucket's "
            "step, and every rank must send them in the same order, which steps on "
            "communication threads (several, concurrently) do not give. Use "
            "step_thread='backward' (the default)."
        )
    if find_unused_parameters:
        raise ConfigurationError(
            "shard_optimizer_state cannot be used with a DDP model built with "
            "find_unused_parameters=True: which parameters each rank steps in a bucket "
            "then depends on what that rank used, where sharding needs every rank to "
            "know which updates each bucket brings. Build the model without "
            "find_unused_parameters (with static_graph=True if some parameters are "
            "unused in every iteration), or use overlap_ddp without "
            "shard_optimizer_state."
        )


def _groups_of(optimizer: torch.optim.Optimizer) -> list[int]:
    """The param group of each of ``optimizer``'s parameters, group by group."""
    return [index for index, group in enumerate(optimizer.param_groups)
            for _ in group["params"]]


class _WaitForExchange:
    """The wrapped module's forward pre-hook (:func:`wait_before_module_forward`).

    It holds the stepper weakly, and is pickled or copied with the module as a no-op
    (``torch.save(ddp_model.module)``, an EMA's ``copy.deepcopy``: the copy's
    parameters are not the exchange's); a closure made ``torch.save`` of the module
    raise pickle's bare error, where plain DDP's saves."""

    def __init__(self, stepper: ShardedBucketStepper) -> None:
        self._stepper: weakref.ref[ShardedBucketStepper] | None = weakref.ref(stepper)

    def __call__(self, module: torch.nn.Module, inputs: Any) -> None:
        stepper = self._stepper() if self._stepper is not None else None
        if stepper is not None:
            stepper.wait_for_parameters()

    def __getstate__(self) -> dict[str, Any]:
        return {"_stepper": None}


def wait_before_module_forward(module: torch.nn.Module, stepper: ShardedBucketStepper) -> None:
    """Wait for the exchange before a call of the wrapped module itself
    (``ddp_model.module(x)``; DDP's own forward pre-hook waits for a call of the DDP
    model: ``stepper.before_forward``).

    The hook holds the stepper weakly and is removed with it: the module outlives the
    DDP model and the optimizer when a loop wraps it again, and a hook holding the
    stepper kept the dropped DDP model (its buckets) and optimizer state alive, which
    also kept the module's parameters claimed (a new ``overlap_ddp`` on them was
    refused)."""
    weakref.finalize(stepper, module.register_forward_pre_hook(_WaitForExchange(stepper)).remove)


def shard_on_ddp(setup: ResolvedSetup) -> ShardedOverlapOptimizer:
    """``overlap_ddp``'s set-up with sharded optimizer state (see
    :func:`overlapkit.overlap_ddp`), after its common checks
    (:func:`~overlapkit.overlap.ddp.setup.check_on_ddp`): what sharding refuses, then
    the owners (a collective, once every rank has passed its checks), then the build:
    the comm hook with the sharded stepper, this rank's share, the exchange."""
    model = setup.model.model
    assert isinstance(model, DistributedDataParallel) and setup.policy is not None
    _refuse_options(setup.step_thread, setup.clipping,
                    find_unused_parameters=bool(model.find_unused_parameters))
    check_shardable(setup.optim_cls, setup.args, setup.optim_kwargs, setup.params)
    _refuse_override(setup.optimizer)
    flat = setup.stepped
    group = model.process_group
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    owners, identity = assign_owners_agreed(
        setup.policy, slots_of(flat, _groups_of(setup.optimizer), setup.model.names),
        world_size, [0] * world_size, group)
    engine, stepper = set_up_on_ddp(setup, stepper_cls=ShardedBucketStepper)
    assert isinstance(stepper, ShardedBucketStepper)
    held = engine.parameters()
    if len(held) != len(flat) or any(a is not b for a, b in zip(held, flat, strict=True)):
        raise AssertionError("the optimizer holds its parameters in another order")
    ownership = Ownership(held, owners, rank, world_size, identity=identity)
    engine.step_only(ownership.mine())
    stepper.plain_holds_state = bool(engine.optimizer.state)  # before the others' is dropped
    drop_state_outside_share(engine.optimizer, ownership)
    stepper.attach(ParameterExchange(
        ownership, {id(p) for p in held if id(p) in setup.model.reduced},
        exchange_group(group, world_size), stepper.side_stream,
        cap_bytes=int(model.bucket_bytes_cap)))
    wait_before_module_forward(model.module, stepper)
    optimizer = ShardedOverlapOptimizer(engine, stepper, setup.model, ownership, setup.policy)
    assert setup.comm_hook is not None  # resolve_on_ddp resolved it
    optimizer._hook_name = setup.comm_hook.name  # for the hook state's messages
    return optimizer
