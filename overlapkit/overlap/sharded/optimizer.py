"""The optimizer ``overlap_ddp(..., shard_optimizer_state=True)`` returns:
:class:`ShardedOverlapOptimizer`.

It is ``overlap_ddp``'s optimizer — a ``torch.optim.Optimizer`` whose steps happen during
backward, one DDP bucket at a time, bitwise plain DDP — with each rank keeping the
optimizer state of its share of the parameters only. The parameters another rank owns
are updated by that rank's broadcast, which lands before ``backward()`` returns. What
differs for the loop:

- ``state_dict()`` is the whole optimizer's state, gathered on demand: call
  :meth:`~ShardedOverlapOptimizer.consolidate_state_dict` on every rank first (as with
  ``ZeroRedundancyOptimizer``), or save with ``overlapkit.checkpoint``, which writes
  each rank's share and reshards; ``local_state_dict()`` is this rank's share.

.. versionadded:: 0.3
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from overlapkit.errors import ConfigurationError, NotPicklableError, OverlapkitError
from overlapkit.overlap.core.engine import OverlapEngine
from overlapkit.overlap.facade import OverlappedOptimizerFacade
from overlapkit.overlap.rebuild import refuse_retired
from overlapkit.overlap.resolved import ModelFacts
from overlapkit.overlap.rules.late_clipping import watch
from overlapkit.overlap.setup import (
    check_unclaimed,
    claim_params,
    flatten_params,
    materialise_params,
)
from overlapkit.overlap.sharded.held_params import flat_params, reordered
from overlapkit.overlap.sharded.hook_state import ShardedCommHookState
from overlapkit.overlap.sharded.hooks import ShardedHooks
from overlapkit.overlap.sharded.misfit import misfit_refusal
from overlapkit.overlap.sharded.model_group import raise_if_groups_gone
from overlapkit.overlap.sharded.ownership import (
    Ownership,
    ShardingPolicy,
    assign_owners,
    drop_state_outside_share,
    slots_of,
)
from overlapkit.overlap.sharded.share_state import ShareOfState
from overlapkit.overlap.sharded.state_dicts import (
    Gathered,
    changed_refusal,
    destination_rank,
    gather_state_dict,
    load_pre_hooked,
    not_gathered_refusal,
    plain_state_dict,
    sharded_state_dict,
    share_fingerprint,
    share_of,
    stale_refusal,
    with_state,
)
from overlapkit.overlap.sharded.stepper import ShardedBucketStepper
from overlapkit.overlap.sharded.torch_api import (
    dcp_stateful_call,
    in_torch_s_initialising_step,
    initialising_step_kept,
    load_template,
    offloaded_refusal,
    offloaded_to,
    share_for_dcp,
    torch_s_broadcast_load,
    torch_s_load_template,
    torch_s_offloaded_get,
)

__all__ = ["TECHNIQUE", "ShardedOverlapOptimizer"]

TECHNIQUE = "overlap_ddp"


class ShardedOverlapOptimizer(ShardedCommHookState, ShardedHooks, OverlappedOptimizerFacade):
    """A ``torch.optim.Optimizer`` stepping during backward, one DDP bucket at a time,
    each rank stepping (and keeping the state of) only the parameters it owns.

    ``param_groups`` hold every parameter on every rank (LR schedulers drive them as
    usual); ``state`` holds this rank's share. See the module docstring for what differs
    from ``overlap_ddp`` without sharding.
    """

    def __init__(self, engine: OverlapEngine, stepper: ShardedBucketStepper,
                 model: ModelFacts, ownership: Ownership, policy: ShardingPolicy) -> None:
        super().__init__(engine, stepper, TECHNIQUE, model.check_params_now)
        self._stepper = stepper
        self._facts = model
        assert isinstance(model.model, DistributedDataParallel)
        self._model = model.model
        self._ownership = ownership
        self._policy = policy
        self._consolidated: Gathered | None = None
        self._state = ShareOfState(engine.optimizer, lambda: stepper.exchange.ownership)
        # a backward refuses param groups changed by hand, before anything steps
        stepper.held_check = weakref.WeakMethod(self._held_refusal)

    # -- what is sharded --------------------------------------------------------

    ownership = property(lambda self: self._ownership, doc="Which rank owns each parameter.")
    policy = property(lambda self: self._policy, doc="The policy that assigned them.")

    @property
    def state(self) -> Any:
        """This rank's share of the optimizer state, live: a read of another rank's
        parameter gives an empty dict and stores nothing (:class:`~overlapkit.overlap.
        sharded.share_state.ShareOfState`)."""
        return self._state

    @state.setter
    def state(self, state: Any) -> None:
        self._engine.optimizer.state = state.real if isinstance(state, ShareOfState) else state

    def owned_parameters(self) -> list[torch.Tensor]:
        """The parameters this rank steps and keeps the optimizer state of."""
        return self._ownership.mine()

    def local_state_params(self) -> set[int]:
        """``id`` of the parameters of this rank's share (``overlapkit.checkpoint``)."""
        return {id(p) for p in self._ownership.mine()}

    def last_buckets(self) -> list[list[torch.Tensor]]:
        """The parameters this rank stepped together in each bucket of the last
        synchronised backward, in bucket order."""
        buckets = self._stepper.last_buckets
        return [list(buckets[i]) for i in sorted(buckets)]

    # -- waiting for the other ranks' updates ------------------------------------

    def synchronize(self) -> None:
        """Wait until every parameter holds its owner's last update (the parameter
        exchange has landed) and, on an accelerator, make the current stream wait for
        the steps and copies on the side stream.

        Done at the end of every backward; called again by :meth:`step`, :meth:`zero_grad`,
        the state-dict methods, checkpoint save and load, and before each forward."""
        self._stepper.wait_for_parameters()

    @contextmanager
    def quiesced(self) -> Iterator[None]:
        """The parameters updated (:meth:`synchronize`), then the engine's lock held:
        what checkpoint save and load work under."""
        self.synchronize()
        with self._engine.lock:
            yield

    # -- param_groups edited by hand (held_params) ----------------------------------

    def replace_param_groups(self, groups: list[dict[str, Any]]) -> None:
        """``optimizer.param_groups = groups``: the same parameters, in any order
        (the ownership follows); parameters added or removed are refused before
        anything changes (:func:`~overlapkit.overlap.sharded.held_params.reordered`)."""
        self.synchronize()
        ownership = reordered(self._ownership, flat_params(groups))
        super().replace_param_groups(groups)
        if ownership is not None:
            self._follow(ownership)

    def _held_now(self) -> None:
        """Follow ``param_groups`` reordered in place; refuse parameters added or
        removed in place (:class:`ConfigurationError`)."""
        ownership = reordered(self._ownership, self._engine.parameters())
        if ownership is not None:
            self._engine.reindex()
            self._follow(ownership)

    def _held_refusal(self) -> OverlapkitError | None:
        """What a stepping backward is refused with (nothing steps in it), or None."""
        try:
            self._held_now()
        except ConfigurationError as error:
            return error
        return None

    def _follow(self, ownership: Ownership) -> None:
        """Use ``ownership``, the same owners in the new order of ``param_groups``: the
        state dicts number the parameters in that order; a gathered state dict, numbered
        in the old one, is released."""
        self._ownership = ownership
        self._stepper.exchange.set_ownership(ownership, self._stepper.exchange.exchanged)
        self._consolidated = None
        self._stepper.consolidated = None

    # -- the Optimizer API --------------------------------------------------------

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """As ``overlap_ddp``'s ``step()``: nothing to do after a backward that stepped
        (it returns once the other ranks' updates have landed). A full step (no stepping
        backward since the last ``step()``) steps this rank's share, then exchanges it.

        torch's initialising step (``get_optimizer_state_dict`` /
        ``set_optimizer_state_dict`` on a rank whose share holds no state) steps
        nothing where the plain optimizer holds state and takes none (it stepped, was
        built with state as Adagrad, or loaded a dict with state): a rank taking it
        alone would hold state the others do not (:func:`~overlapkit.overlap.sharded.
        torch_api.in_torch_s_initialising_step`). Else it steps this rank's share, as a
        plain optimizer's (also after loading a dict without state: 0.4.0 skipped it there,
        and Adam's ``step`` counts then trailed the plain ones by one), and exchanges
        nothing (at ``lr`` 0 it changes no parameter: :func:`~overlapkit.overlap.sharded.
        torch_api.initialising_step_kept`), so a rank may take it alone."""
        refuse_retired(self._steps, "step()")
        stepper = self._stepper
        initialising = closure is None and in_torch_s_initialising_step()
        if initialising and stepper.plain_holds_state:
            return
        full = not self._stepper.stepped_since_step
        if full:  # (a stepping backward checked param_groups when it started)
            stepper.before_full_step(agree=not initialising)
            self.synchronize()
            self._held_now()
        with initialising_step_kept(self._ownership.mine(), self._engine.optimizer) \
                if initialising and full else nullcontext():
            super().step(closure)
        if full:
            stepper.advance() if initialising else stepper.full_step_taken()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` (of the DDP model's process
        group), for :meth:`state_dict` there. Call it on every rank (a collective), after
        the last step to be saved: a step after it makes the gathered state stale, and
        ``state_dict()`` then refuses it.

        Rank ``to`` then holds every rank's state, as CPU tensors (as
        ``ZeroRedundancyOptimizer.consolidate_state_dict`` does); ``overlapkit.checkpoint``
        saves without gathering. Called on some ranks while the others start a backward
        or ``step()``, it is refused at once on those (nothing gathered or stepped).
        """
        to = destination_rank(to, self._ownership.world_size)
        raise_if_groups_gone(self._stepper, self._model, "consolidate_state_dict()")
        self.synchronize()
        self._held_now()
        self._stepper.meet("consolidate_state_dict()")  # every rank here, else refused
        with self._engine.lock:
            local = plain_state_dict(self._engine.optimizer)
            share = share_fingerprint(self._engine.optimizer, self._ownership)
        gathered = gather_state_dict(local, self._ownership, self._model.process_group, to)
        self._stepper.consolidated = None if gathered is None else gathered["state"]
        self._consolidated = Gathered(to, self._stepper.generation,
                                      None if gathered is None else share)

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state dict, in the plain optimizer's format (it loads
        into a plain optimizer of the same class, ``overlap_ddp`` without sharding, or a
        sharded one at any world size).

        At world size 1 it is read directly. Otherwise it is the one
        :meth:`consolidate_state_dict` gathered on this rank since the last step; read
        by torch's ``set_optimizer_state_dict(..., full_state_dict=True)``, this rank's
        share (:func:`~overlapkit.overlap.sharded.torch_api.load_template`); by its
        ``get_optimizer_state_dict`` with ``full_state_dict`` and ``cpu_offload``, the
        gathered state on global rank 0 (which torch keeps) and the share elsewhere
        (torch returns ``{}`` there). A comm hook's state (PowerSGD's) is in
        :meth:`local_state_dict` only.

        :raises ConfigurationError: at world size > 1, no current consolidated state
            dict on this rank (never gathered, gathered on another rank, or a step since).
        """
        return self._with_whole_hook_state(self._whole_state_dict())

    def _whole_state_dict(self) -> dict[str, Any]:
        self.synchronize()
        self._held_now()
        if self._ownership.world_size == 1:
            return self._engine.state_dict()
        if (given := torch_s_load_template()) is not None:
            return load_template(self._engine.state_dict(), self._ownership, given)
        if (dcp := dcp_stateful_call()) and not torch_s_offloaded_get():  # DCP's: shares
            loading = dcp == "load"
            return share_for_dcp(self._engine.state_dict(), self._ownership,
                                 self.checkpoint_refusal(loading=loading), loading=loading)
        held, rank = self._consolidated, self._ownership.rank
        current = held is not None and held.generation == self._stepper.generation
        if torch_s_offloaded_get():  # the whole state on global rank 0, {} elsewhere
            to = offloaded_to(self._model.process_group)
            if not current or held is None or held.to != to:
                raise offloaded_refusal(to)
            if rank != to:  # torch returns {} here, as for a plain optimizer
                return self._engine.state_dict()
        if held is None or held.to != rank:
            raise not_gathered_refusal(None if held is None else held.to, rank)
        if not current:
            raise stale_refusal()
        if held.share is not None and (changed := changed_refusal(
                held.share, share_fingerprint(self._engine.optimizer, self._ownership),
                self._ownership, self._facts.names)) is not None:
            raise changed
        # the current param groups (an LR scheduler may have stepped since the
        # gathering, as ZeroRedundancyOptimizer's state_dict() does) and the state
        # hooks: the real optimizer's state_dict(), its share's state replaced by the
        # whole (gathered) state
        gathered = self._stepper.consolidated
        with self._engine.lock:
            return with_state(self._engine.optimizer, gathered)

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's share of the state, with the ownership it belongs to: for saving
        one file per rank (``torch.save(opt.local_state_dict(), f"optim-{rank}.pt")``)
        and loading it back at the same world size. No communication."""
        self.synchronize()
        self._held_now()
        with self._engine.lock:
            local = self._engine.state_dict()
        return self._with_local_hook_state(sharded_state_dict(local, self._ownership))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state dict (from :meth:`state_dict`, a plain optimizer of the same
        class, or ``overlap_ddp`` without sharding, saved at any world size) keeping this
        rank's share, or this rank's own :meth:`local_state_dict`.

        :raises ConfigurationError: a sharded state dict saved at another world size,
            with another ownership, or by another rank; not a state dict; one a step
            would fail after (:func:`~overlapkit.overlap.sharded.misfit.
            misfit_refusal`); called between a stepping backward and ``step()`` (as
            without sharding). Nothing is changed then.
        """
        if (refusal := self._steps.window_refusal("optimizer.load_state_dict()",
                                                  loading=True)) is not None:
            raise ConfigurationError(f"{refusal} Nothing was loaded.")
        state_dict, load_hook_state = self._without_hook_state(state_dict)  # checked
        self.synchronize()
        self._held_now()
        state_dict, hooks_run = load_pre_hooked(self._engine.optimizer, state_dict,
                                                share=torch_s_broadcast_load())
        share = share_of(state_dict, self._ownership)
        whole = state_dict if "state" in state_dict else share  # (a local one: the share)
        if not torch_s_broadcast_load() and (
                misfit := misfit_refusal(self._engine.optimizer, whole, self._model)) is not None:
            raise misfit
        with hooks_run:
            self._engine.load_state_dict(share)
        load_hook_state()
        # a whole dict without state (DCP's template: empty entries) empties the plain
        # optimizer's (torch's initialising step then steps it on every rank)
        self._stepper.advance(holds_state="state" not in state_dict or torch_s_broadcast_load()
                              or any(map(bool, state_dict["state"].values())))
        self._consolidated = None

    def meet_for_checkpoint(self, *, loading: bool = False) -> None:
        """Before ``overlapkit.checkpoint``'s collectives: its groups gone, ranks elsewhere."""
        what = f"overlapkit.checkpoint.{'load' if loading else 'save'}"
        raise_if_groups_gone(self._stepper, self._model, what)
        self._stepper.meet(what)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of the model's parameters; the sharding policy assigns them to
        ranks, balanced against what each rank owns already. Call it on every rank (the
        ranks check that they agree: a collective)."""
        refuse_retired(self._steps, "add_param_group()")
        self._stepper.raise_if_destroyed("add_param_group()")
        (group,) = materialise_params([param_group])
        self._held_now()
        facts = self._facts.now()
        facts.check_params([group], self._engine.optimizer)
        engine = self._engine
        params = flatten_params([group])
        known = {id(p) for p in engine.parameters()}
        # parameters the optimizer holds already are left to its own error
        check_unclaimed([p for p in params if id(p) not in known], self._technique)
        ownership = self._ownership
        slots = slots_of(params, [len(engine.param_groups)] * len(params), facts.names,
                         start=len(ownership.params))
        owners = assign_owners(self._policy, slots, ownership.world_size,
                               ownership.loads(), self._model.process_group)
        self.synchronize()
        engine.add_param_group(group)
        ownership = ownership.extended(params, owners)
        engine.step_only(ownership.mine())
        drop_state_outside_share(engine.optimizer, ownership)
        self._ownership = ownership
        self._stepper.exchange.set_ownership(
            ownership, {id(p) for p in ownership.params if id(p) in facts.reduced})
        self._steps.register(params)
        claim_params(params, self._technique)
        # a torch clip after a stepping backward is answered or refused for these too
        watch(params, self._steps)
        self._consolidated = None
        self._stepper.consolidated = None

    def __getstate__(self) -> dict[str, Any]:
        raise NotPicklableError(
            f"this {type(self).__name__} is bound to a live model and its ranks' process group, "
            "and holds only this rank's share of the state, so it cannot be pickled or "
            "deep-copied. Save the state instead: overlapkit.checkpoint.save(path, model, "
            "optimizer) on every rank; or consolidate_state_dict(to=0) on every rank, then "
            "state_dict() on rank 0 (the whole state); or local_state_dict() (this rank's share).")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self._engine.optimizer!r}, rank {self._ownership.rank}"
                f" of {self._ownership.world_size}, {self._policy!r})")
