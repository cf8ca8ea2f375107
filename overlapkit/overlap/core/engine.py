"""The engine every overlapped technique steps through: :class:`OverlapEngine`.

An overlapped optimizer owns one *real* ``torch.optim.Optimizer`` instance and steps
exactly a given subset of its parameters (one DDP gradient bucket, or one parameter
during backward) whenever asked, from whichever thread asks. Everything that is not a
step (``param_groups``, ``state``, ``state_dict()``, LR schedulers) stays the real
optimizer's, so checkpoints have the plain optimizer's format.

The generic implementation, registered by the built-in plugin ``overlapkit.overlap``
for ``torch.optim.Optimizer``, serves every optimizer class. A plugin registers a faster
one for its own optimizer class (most specific class in the MRO wins) by subclassing
:class:`OverlapEngine` and implementing :meth:`OverlapEngine.step_groups`::

    class LionOverlapped(overlapkit.OverlapEngine):
        def step_groups(self, groups):
            for group, params in groups:
                ...  # torch._foreach_* over params, reading group["lr"], self.state[p]

    @overlapkit.hookimpl
    def overlapkit_register_optimizers():
        return overlapkit.OptimizerRecord(optim_cls=Lion, overlapped_cls=LionOverlapped)

.. versionadded:: 0.1
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from overlapkit.errors import UnsupportedOptimizerError
from overlapkit.overlap.core.closures import required_closure_refusal

__all__ = ["OverlapEngine", "OverlappedOptimizer", "ParamGroup", "StepPlan"]

#: one ``param_groups`` entry of a torch optimizer
ParamGroup = dict[str, Any]


@attrs.frozen(eq=False)
class StepPlan:
    """A subset of an engine's parameters, sorted by param group: what
    :meth:`OverlapEngine.step_plan` steps.

    Callers that step the same subset again and again (a DDP bucket, one parameter)
    build it once with :meth:`OverlapEngine.plan` and keep it while
    :attr:`OverlapEngine.layout_version` equals :attr:`version`: grouping a bucket's
    parameters anew at each step was a measured part of the engine's per-bucket cost.

    :param version: the engine's :attr:`~OverlapEngine.layout_version` it was built at.
    :param requested: the parameters it was made of (owned or not).
    :param params: the owned ones, in the caller's order.
    :param groups: ``(index in param_groups, that group's parameters of the subset)``,
        by increasing index.

    ``kept`` is where an engine keeps what it works out for this subset from one step
    to the next (the generic engine: the optimizer's tensor lists,
    :mod:`overlapkit.overlap.core.tensor_lists`): it lives, and is freed, with the plan.
    """

    version: int
    requested: list[torch.Tensor]
    params: list[torch.Tensor]
    groups: list[tuple[int, list[torch.Tensor]]]
    kept: dict[int, Any] = attrs.field(factory=dict, init=False, repr=False)


class OverlapEngine:
    """Steps chosen subsets of one real optimizer's parameters, thread-safely.

    Build it around an optimizer instance; call :meth:`step_params` with the
    parameters whose ``.grad`` is ready (a bucket, or one parameter). Steps from
    different threads are serialised by :attr:`lock` (DDP runs comm-hook callbacks on
    gloo worker threads, two at a time by default).

    Subclasses implement :meth:`step_groups`; they may override
    :meth:`check_supported` to accept or refuse optimizer classes.

    :param optimizer: the real optimizer; its ``param_groups`` and ``state`` are the
        ones checkpoints save and LR schedulers drive.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.check_supported(type(optimizer))
        self.optimizer = optimizer
        #: held while a step, ``load_state_dict`` or ``zero_grad`` runs
        self.lock = threading.RLock()
        # keyed by id(): Tensor.__hash__ is a Python-level call, id() is not
        self._group_of: dict[int, int] = {}
        #: ids of every parameter of the real optimizer, stepped here or not
        self._held: frozenset[int] = frozenset()
        self._layout_version = 0
        #: ids of the parameters this engine steps, or None for all (see step_only)
        self._stepped: frozenset[int] | None = None
        self.reindex()

    # -- what subclasses implement ----------------------------------------------

    @classmethod
    def check_supported(cls, optim_cls: type[torch.optim.Optimizer]) -> None:
        """Raise :class:`~overlapkit.errors.UnsupportedOptimizerError` when this
        implementation cannot step ``optim_cls`` one subset of parameters at a time.

        Called once at set-up, before the optimizer is built. The default refuses
        optimizers that need a closure (``LBFGS``) or sparse gradients
        (``SparseAdam``), which no gradient bucket provides, and the distributed
        wrappers of ``torch.distributed.optim`` (``ZeroRedundancyOptimizer``,
        ``PostLocalSGDOptimizer``), whose ``step()`` communicates across ranks.
        """
        if issubclass(optim_cls, torch.optim.LBFGS):
            raise UnsupportedOptimizerError(
                f"{optim_cls.__qualname__} needs a closure that re-evaluates the whole "
                "model, so it cannot step one bucket of parameters while backward runs; "
                "use it without overlap, or choose a closure-free optimizer (e.g. AdamW)."
            )
        refusal = required_closure_refusal(optim_cls)
        if refusal is not None:
            raise refusal
        if optim_cls.__module__.startswith("torch.distributed.optim"):
            raise UnsupportedOptimizerError(
                f"{optim_cls.__qualname__} is a distributed wrapper (its step() shards, "
                "averages or broadcasts across ranks itself), so stepping it one bucket "
                "or parameter at a time from inside backward would give wrong values or "
                "hang; pass the local optimizer class it wraps (e.g. torch.optim.AdamW) "
                "instead, or use the wrapper without overlap."
            )
        if issubclass(optim_cls, torch.optim.SparseAdam):
            raise UnsupportedOptimizerError(
                f"{optim_cls.__qualname__} steps sparse gradients only (an "
                "nn.Embedding(sparse=True)'s), and overlapkit's steps during backward "
                "take dense ones, on any model (a DDP bucket never holds a sparse "
                "gradient); use torch.optim.Adam with overlap (and sparse=False on the "
                "embeddings), or SparseAdam in a plain loop (its step() after backward)."
            )

    def step_groups(self, groups: Sequence[tuple[ParamGroup, list[torch.Tensor]]]) -> None:
        """Step exactly these parameters: ``groups`` pairs each affected entry of
        ``param_groups`` (the live dict: read hyperparameters from it) with the
        parameters of that group to step (in the caller's order: bucket order for
        DDP). Every parameter has its ``.grad`` set. Called with :attr:`lock` held.
        """
        raise NotImplementedError(
            f"{type(self).__qualname__} must implement step_groups(groups)"
        )

    # -- the interface callers use ------------------------------------------------

    @property
    def param_groups(self) -> list[ParamGroup]:
        """The real optimizer's live ``param_groups``."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The real optimizer's per-parameter ``state``."""
        return self.optimizer.state

    def parameters(self) -> list[torch.Tensor]:
        """Every parameter of the real optimizer, group by group."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def owns(self, param: torch.Tensor) -> bool:
        """Whether this engine steps ``param``: one of the real optimizer's parameters
        (and, after :meth:`step_only`, one of those it was given)."""
        return id(param) in self._group_of

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the real optimizer's parameters, stepped by this
        engine or (after :meth:`step_only`) by another rank's."""
        return id(param) in self._held

    def step_only(self, params: Iterable[torch.Tensor] | None) -> None:
        """From now on step only ``params`` among the real optimizer's parameters (None:
        all of them, the default).

        Sharded optimizer state (``overlap_ddp(..., shard_optimizer_state=True)``) sets
        each rank's share here: the other parameters stay in ``param_groups`` (LR
        schedulers, the ``state_dict()`` format, global clipping and a GradScaler read
        them all), but no step — per bucket, global or full — touches them, so they
        never get optimizer state on this rank. Thread-safe.

        .. versionadded:: 0.3
        """
        with self.lock:
            self._stepped = None if params is None else frozenset(id(p) for p in params)
            self.reindex()

    @property
    def indexed(self) -> int:
        """How many parameters the real optimizer held at the last :meth:`reindex` (one
        added behind the engine's back shows as a difference,
        :mod:`~overlapkit.overlap.core.groups_behind`)."""
        return len(self._held)

    @property
    def layout_version(self) -> int:
        """Changes whenever which parameters the engine owns, or their groups, may have
        changed (:meth:`reindex`): a :class:`StepPlan` of another version is stale."""
        return self._layout_version

    def plan(self, params: Iterable[torch.Tensor]) -> StepPlan:
        """The :class:`StepPlan` of ``params``: the owned ones, by param group (the
        others are left out)."""
        group_of = self._group_of
        requested = list(params)
        owned: list[torch.Tensor] = []
        chosen: dict[int, list[torch.Tensor]] = {}
        for param in requested:
            index = group_of.get(id(param))
            if index is not None:
                owned.append(param)
                chosen.setdefault(index, []).append(param)
        return StepPlan(self._layout_version, requested, owned,
                        [(index, chosen[index]) for index in sorted(chosen)])

    def step_plan(self, plan: StepPlan) -> None:
        """Step the parameters of ``plan`` (each must have ``.grad`` set). A plan made
        before the last :meth:`reindex` is made again. Thread-safe."""
        with self.lock:
            if plan.version != self._layout_version:
                plan = self.plan(plan.requested)
            if plan.groups:
                groups = self.optimizer.param_groups
                self.step_planned(plan, [(groups[index], params)
                                         for index, params in plan.groups])

    def step_planned(self, plan: StepPlan,
                     groups: Sequence[tuple[ParamGroup, list[torch.Tensor]]]) -> None:
        """Step ``groups``, the live groups of ``plan`` (current) with its parameters:
        :meth:`step_groups`, for an engine that keeps nothing in :attr:`StepPlan.kept`.
        Called with :attr:`lock` held."""
        self.step_groups(groups)

    def step_params(self, params: Iterable[torch.Tensor]) -> None:
        """Step exactly ``params`` (each must have ``.grad`` set); the ones this
        optimizer does not own are skipped. Thread-safe."""
        self.step_plan(self.plan(params))

    def step(self) -> None:
        """One ordinary step of every parameter that has a gradient (of those given to
        :meth:`step_only`, when it was called). Thread-safe."""
        with self.lock:
            if self._stepped is None:
                self.optimizer.step()
            else:
                self.step_params(self.parameters())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The real optimizer's ``zero_grad``. Thread-safe."""
        with self.lock:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The real optimizer's ``state_dict()``: the plain format. Thread-safe."""
        with self.lock:
            return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The real optimizer's ``load_state_dict``. Thread-safe."""
        with self.lock:
            self.optimizer.load_state_dict(state_dict)
            self.reindex()

    def add_param_group(self, param_group: ParamGroup) -> None:
        """The real optimizer's ``add_param_group``. Thread-safe."""
        with self.lock:
            self.optimizer.add_param_group(param_group)
            self.reindex()

    def reindex(self) -> None:
        """Rebuild the parameter -> group index after ``param_groups`` changed.

        Called by :meth:`load_state_dict` and :meth:`add_param_group`; call it after
        editing ``param_groups[i]["params"]`` by hand.
        """
        with self.lock:
            stepped = self._stepped
            every = [(id(param), index)
                     for index, group in enumerate(self.optimizer.param_groups)
                     for param in group["params"]]
            self._held = frozenset(key for key, _ in every)
            self._group_of = {key: index for key, index in every
                              if stepped is None or key in stepped}
            self._layout_version += 1

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({type(self.optimizer).__qualname__})"


#: The 0.1 name of :class:`OverlapEngine`, kept as an alias for existing plugins (it read
#: like the optimizer users get back, which is the facade).
OverlappedOptimizer = OverlapEngine
