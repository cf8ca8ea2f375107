"""Which rank owns which parameter: the sharding policy, and its answer checked.

Each rank keeps the optimizer state of, and steps, only the parameters it owns; whole
parameters, so that any optimizer works (Lion, Adafactor and friends need a whole
parameter, or its whole gradient, per update). A :class:`ShardingPolicy` decides, once
at set-up (and for the parameters of a later ``add_param_group``), from what every rank
knows alike — names, shapes, dtypes, param groups — never from tensor values or
addresses, so that its answer is the same on every rank and in every run. The default,
:class:`SizeBalancedPolicy`, is the greedy largest-first assignment
``ZeroRedundancyOptimizer`` uses: each rank then holds at most
``total / world_size + the largest parameter`` of the state bytes.

A policy is a strategy object passed as ``overlap_ddp(..., shard_optimizer_state=policy)``
rather than a fifth plugin hook: it is chosen per model and takes options (a rank to pin
the embedding to, weights per layer), which a name in a registry would have to carry
anyway, and a plugin ships one as a class its users construct.

.. versionadded:: 0.3
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from overlapkit.errors import ConfigurationError
from overlapkit.nodes.failed_collective import collective_failure

__all__ = ["Ownership", "ParamSlot", "ShardingPolicy", "SizeBalancedPolicy",
           "all_gather_named", "assign_owners", "assign_owners_agreed",
           "drop_state_outside_share", "slots_of"]


@attrs.frozen(kw_only=True)
class ParamSlot:
    """What a :class:`ShardingPolicy` knows of one parameter: the same on every rank.

    :param index: its position among the optimizer's parameters (group by group), the
        index of its entry in the optimizer's ``state_dict()``.
    :param name: its name in the model (``model.module.named_parameters()``).
    :param shape: its shape.
    :param dtype: its dtype.
    :param group: the index of its param group.
    :param trainable: ``requires_grad``: frozen parameters are never stepped and have no
        state, so owning one costs nothing.
    """

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: int
    trainable: bool

    @property
    def numel(self) -> int:
        """Its number of elements."""
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        """Its size in bytes (an optimizer's state is usually a multiple of it)."""
        return self.numel * self.dtype.itemsize


class ShardingPolicy:
    """Decides which rank owns (steps, and keeps the optimizer state of) each parameter.

    Subclass it and implement :meth:`assign`; pass an instance as
    ``overlap_ddp(..., shard_optimizer_state=policy)``. Its answer must depend only on
    what it is given (the same on every rank): overlapkit checks that every rank got
    the same one, and refuses the set-up otherwise.

    .. versionadded:: 0.3
    """

    def assign(self, params: Sequence[ParamSlot], world_size: int, *,
               loads: Sequence[int]) -> Sequence[int]:
        """The owning rank (``0 <= rank < world_size``) of each of ``params``, in order.

        :param params: the parameters to assign: every parameter at set-up, the new ones
            at ``add_param_group``.
        :param world_size: the ranks of the DDP model's process group.
        :param loads: what each rank owns already, in bytes of parameters (zeros at
            set-up), so that parameters added later can balance against it.
        """
        raise NotImplementedError(f"{type(self).__qualname__} must implement assign()")

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}()"


class SizeBalancedPolicy(ShardingPolicy):
    """Largest parameter first, each to the rank that owns the fewest bytes so far (the
    lowest rank on a tie); frozen parameters weigh nothing.

    Stable: the answer depends only on the parameters' sizes and order. Balanced: no
    rank owns more than ``total / world_size`` plus the largest parameter (greedy list
    scheduling's bound), which is the optimizer-state bound per rank as well for every
    optimizer whose state is a multiple of its parameters (Adam: 2x).
    """

    def assign(self, params: Sequence[ParamSlot], world_size: int, *,
               loads: Sequence[int]) -> list[int]:
        owned = list(loads)
        owners = [0] * len(params)
        weight = [slot.nbytes if slot.trainable else 0 for slot in params]
        for position in sorted(range(len(params)), key=lambda i: (-weight[i], i)):
            rank = min(range(world_size), key=lambda r: (owned[r], r))
            owners[position] = rank
            owned[rank] += weight[position]
        return owners


@attrs.define(eq=False)
class Ownership:
    """Who owns each of the optimizer's parameters, and what follows for this rank.

    :param params: the optimizer's parameters, group by group (``state_dict()`` order).
    :param owners: the owning rank of each, in the DDP process group's numbering.
    :param rank: this rank, in that numbering.
    :param world_size: the process group's size.
    :param identity: which sharded optimizer this is, the same on each of its ranks and
        different from any other's (group rank 0's token, agreed at set-up by
        :func:`assign_owners`): two optimizers of one class over parameters of the same
        shapes have nothing else telling them apart.
    """

    params: list[torch.Tensor]
    owners: list[int]
    rank: int
    world_size: int
    identity: str = attrs.field(default="", kw_only=True)
    _owner_of: dict[int, int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._owner_of = {id(p): r for p, r in zip(self.params, self.owners, strict=True)}

    def owner_of(self, param: torch.Tensor) -> int | None:
        """The rank owning ``param``; None for a parameter the optimizer does not hold."""
        return self._owner_of.get(id(param))

    def mine(self) -> list[torch.Tensor]:
        """The parameters this rank owns, in optimizer order."""
        return [p for p, r in zip(self.params, self.owners, strict=True) if r == self.rank]

    def my_indices(self) -> set[int]:
        """The ``state_dict()`` indices of the parameters this rank owns."""
        return {i for i, r in enumerate(self.owners) if r == self.rank}

    def loads(self) -> list[int]:
        """The bytes of trainable parameters each rank owns."""
        owned = [0] * self.world_size
        for param, rank in zip(self.params, self.owners, strict=True):
            if param.requires_grad:
                owned[rank] += param.numel() * param.element_size()
        return owned

    def extended(self, params: Sequence[torch.Tensor], owners: Sequence[int]) -> Ownership:
        """This ownership with ``params`` (added to the optimizer) owned by ``owners``."""
        return Ownership([*self.params, *params], [*self.owners, *owners], self.rank,
                         self.world_size, identity=self.identity)

    def describe(self) -> dict[str, Any]:
        """What a sharded state dict records of it: world size, rank, owner per index."""
        return {"world_size": self.world_size, "rank": self.rank, "owners": list(self.owners)}


def slots_of(params: Sequence[torch.Tensor], groups: Sequence[int], names: dict[int, str],
             start: int = 0) -> list[ParamSlot]:
    """The :class:`ParamSlot` of each of ``params`` (``groups``: each one's group index;
    ``names``: ``id(param)`` -> name in the model; ``start``: the first one's index)."""
    return [ParamSlot(index=start + i, name=names.get(id(p), f"#{start + i}"),
                      shape=tuple(p.shape), dtype=p.dtype, group=group,
                      trainable=p.requires_grad)
            for i, (p, group) in enumerate(zip(params, groups, strict=True))]


def _digest(owners: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, owners)).encode()).hexdigest()


def all_gather_named(obj: Any, group: Any, what: str) -> list[Any]:
    """``dist.all_gather_object`` of ``obj`` over ``group``, a rank that does not take
    part named: a rank that skipped the call (``add_param_group()`` or
    ``consolidate_state_dict()`` on some ranks only) made the others raise gloo's bare
    ``RuntimeError`` at the group's timeout (``Timed out waiting 5000ms for send
    operation to complete``), and the next backward another bare one; it is the
    :class:`~overlapkit.errors.ExchangeFailedError` (or ``RanksLostError``) of
    :func:`~overlapkit.nodes.failed_collective.collective_failure` now, ``what``
    saying which call."""
    out: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except Exception as error:
        failed = collective_failure(error, what, group)
        if failed is None:
            raise
        raise failed from error
    return out


def assign_owners(policy: ShardingPolicy, slots: Sequence[ParamSlot], world_size: int,
                  loads: Sequence[int], group: Any) -> list[int]:
    """The owners of :func:`assign_owners_agreed` (for ``add_param_group``)."""
    return assign_owners_agreed(policy, slots, world_size, loads, group)[0]


def assign_owners_agreed(policy: ShardingPolicy, slots: Sequence[ParamSlot],
                         world_size: int, loads: Sequence[int], group: Any
                         ) -> tuple[list[int], str]:
    """Ask ``policy`` for the owners of ``slots``; check the answer, and that every rank
    of ``group`` got the same one (one small ``all_gather_object``); with them, an
    identity every rank agrees on (group rank 0's random token, sent in the same
    gathering: :attr:`Ownership.identity`).

    Called at set-up, before anything changes, on every rank.

    :raises ConfigurationError: the policy raised, returned the wrong number of ranks or a
        rank out of range, or ranks disagree.
    """
    try:
        answer = list(policy.assign(slots, world_size, loads=list(loads)))
    except Exception as exc:
        raise ConfigurationError(
            f"the sharding policy {policy!r} raised {type(exc).__name__}: {exc}; fix the "
            "policy (it is asked once per set-up, with every parameter)."
        ) from exc
    if len(answer) != len(slots):
        raise ConfigurationError(
            f"the sharding policy {policy!r} returned {len(answer)} owners for "
            f"{len(slots)} parameters; return one rank per parameter, in order."
        )
    for slot, rank in zip(slots, answer, strict=True):
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigurationError(
                f"the sharding policy {policy!r} gave parameter {slot.name!r} the owner "
                f"{rank!r}; owners are ranks from 0 to {world_size - 1} (the DDP model's "
                "process group)."
            )
    token = uuid.uuid4().hex
    if world_size > 1:
        gathered = all_gather_named(
            (_digest(answer), token), group,
            "agreeing on the owners of the parameters (the set-up of sharded optimizer "
            "state, or add_param_group(), which every rank of the DDP model's process "
            "group calls)")
        digests = [digest for digest, _ in gathered]
        token = gathered[0][1]
        if len(set(digests)) > 1:
            differing = [r for r, d in enumerate(digests) if d != digests[0]]
            raise ConfigurationError(
                f"the sharding policy {policy!r} assigned the parameters differently on "
                f"ranks {differing} than on rank 0, so ranks would wait for updates no "
                "rank sends; a policy must decide only from what it is given (names, "
                "shapes, dtypes, groups: the same on every rank), never from values, "
                "addresses or randomness. Nothing was changed."
            )
    return answer, token


def drop_state_outside_share(optimizer: torch.optim.Optimizer, ownership: Ownership) -> None:
    """Remove the state the optimizer's constructor gave the parameters other ranks own
    (``Adagrad`` creates its ``sum`` for every parameter when built): they are never
    stepped here, and their state is their owner's."""
    mine = {id(p) for p in ownership.mine()}
    state = optimizer.state
    for param in [p for p in state if id(p) not in mine]:
        del state[param]
