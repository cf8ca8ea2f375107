"""The comm hook of sharded optimizer state: each bucket's owned parameters stepped as
its reduction completes, then the bucket's updated parameters exchanged, every update
landed when ``backward()`` returns.

:class:`ShardedBucketStepper` is :class:`~overlapkit.overlap.ddp.bucket_stepper.BucketStepper`
(the engine steps only this rank's share: ``OverlapEngine.step_only``) plus the
:class:`~overlapkit.overlap.sharded.exchange.ParameterExchange`: after each bucket's
step, on every rank, in bucket order, the bucket's parameters are broadcast from their
owners; when every step waits for the end of backward (global clipping, a GradScaler) or
parameters are stepped after DDP's finalize (``static_graph``, whose buckets step only
what this rank used), everything is exchanged once the steps are done.

.. versionadded:: 0.3
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.errors import ConfigurationError, OverlapkitError
from overlapkit.overlap.core.backward_scope import OUTSIDE
from overlapkit.overlap.ddp.bucket_stepper import BucketStepper
from overlapkit.overlap.ddp.bucket_steps import PendingBucket
from overlapkit.overlap.sharded.agreement import SettingsAgreement
from overlapkit.overlap.sharded.exchange import ParameterExchange
from overlapkit.overlap.sharded.grad_agreement import gradients_digest

__all__ = ["ShardedBucketStepper", "destroyed_group_refusal", "join_refusal"]


def join_refusal() -> ConfigurationError:
    """The error of ``ddp_model.join()`` (uneven inputs) with sharded optimizer state."""
    return ConfigurationError(
        "ddp_model.join() (uneven inputs) cannot be used with shard_optimizer_state: a "
        "rank that has run out of inputs would neither step the parameters it owns nor "
        "send them, and the other ranks would wait for them. Give every rank the same "
        "number of batches (drop the last uneven ones, e.g. DistributedSampler("
        "drop_last=True)), or use overlap_ddp without shard_optimizer_state."
    )


def destroyed_group_refusal(what: str) -> ConfigurationError:
    """``what`` after the process groups the sharded optimizer was built on were
    destroyed (``dist.destroy_process_group()``, then maybe ``init_process_group``
    again): the exchange's broadcast raised torch's bare ``ValueError`` ("not initialized
    in the world group map") from inside the comm hook, after this rank had stepped its
    share of the bucket (measured: 2 gloo ranks; DDP's own allreduce still ran)."""
    return ConfigurationError(
        f"{what}: the process groups this sharded optimizer exchanges on were destroyed "
        "(dist.destroy_process_group()) since it was built. A DDP model and its "
        "optimizer are bound to their process group: after init_process_group, wrap the "
        "module in a new DDP model and call overlap_ddp again (loading the state saved "
        "before: overlapkit.checkpoint, or the optimizer's state dicts). Nothing was "
        "stepped.")


class ShardedBucketStepper(BucketStepper):
    """A :class:`BucketStepper` whose steps are followed by the parameter exchange.

    ``exchange`` is set by the set-up right after the comm hook is registered (nothing
    runs in between). Exchanges are launched on the thread running backward only
    (``step_thread="backward"``), so every rank launches them in the same order.
    """

    exchange: ParameterExchange
    #: whether the ranks step with the same settings (launched when a backward starts,
    #: read before its first step): set with the exchange
    agreement: SettingsAgreement
    #: the sharded optimizer refuses step hooks; one on the real optimizer is per share
    step_hooks_are_the_loops = False
    #: whether each bucket is exchanged right after its step (else everything is, once
    #: backward's steps are done): set at set-up from the stepper's mode
    per_bucket: bool
    #: counts the steps taken (stepping backwards, full steps, loads): a consolidated
    #: state dict is of one generation
    generation: int = 0
    #: whether the plain optimizer would hold state now (it was built with some, as
    #: Adagrad's ``sum``; it stepped; it loaded a dict with state): it takes no
    #: initialising step of torch's then, nor does this one (a rank's share alone
    #: cannot tell). Loading a dict without state empties it, as the plain one's
    plain_holds_state: bool = False
    #: the whole state gathered by ``consolidate_state_dict`` (the optimizer's record),
    #: released as soon as it is stale: it is the size of the whole optimizer state
    consolidated: Any = None
    #: asked when a stepping backward starts: the error refusing param groups changed
    #: by hand, or None; a weak method of the optimizer (the DDP model holds this
    #: stepper in C++, where a cycle back to the model is never collected)
    held_check: Callable[[], Callable[[], OverlapkitError | None] | None] | None = None

    def advance(self, *, holds_state: bool = True) -> None:
        """A step was taken (or state loaded: ``holds_state``, whether the whole dict
        held any): a new generation, and the gathered state dict, stale now, is
        released."""
        self.generation += 1
        self.consolidated = None
        self.plain_holds_state = holds_state

    def attach(self, exchange: ParameterExchange) -> None:
        """Give the stepper its exchange (at set-up)."""
        self.exchange = exchange
        self.per_bucket = self.global_step is None and not self.track_usage
        self.agreement = SettingsAgreement(self.engine.optimizer, exchange.group)

    def exchanging(self) -> bool:
        """Whether the exchange's group can be used now (not destroyed, no failure)."""
        exchange = self.exchange
        return exchange.active and exchange.failure is None and \
            exchange.group in dist.distributed_c10d._world.pg_map

    def starting_backward(self) -> OverlapkitError | None:
        # the settings check, launched on every rank whatever this backward becomes
        # (refused, deferred), as the exchange's broadcasts are issued: in bucket order
        if self.exchanging():
            self.agreement.launch()
        return super().starting_backward()

    def _settings_refused(self) -> None:
        """Read the settings check of this backward, if not yet: nothing steps in it
        when the ranks' settings differ (:mod:`~overlapkit.overlap.sharded.agreement`)."""
        refused = self._kept_failure(self.agreement.refusal())
        if refused is not None and self._step_error is None:
            self._step_error = refused

    def _kept_failure(self, refused: Exception | None) -> Exception | None:
        """``refused``, kept as the exchange's failure when it is a peer's (it stalled or
        is gone): nothing more is sent then, and every later wait raises it."""
        if refused is not None and not isinstance(refused, ConfigurationError) \
                and self.exchange.failure is None:
            self.exchange.failure = refused
        return refused

    def before_full_step(self, *, agree: bool) -> None:
        """Before ``step()`` steps this rank's share with no stepping backward before it
        (``agree``: unless torch's initialising step, which a rank may take alone).

        :raises ConfigurationError: the exchange's group was destroyed; the ranks'
            settings, or gradients, differ (nothing stepped;
            :mod:`~overlapkit.overlap.sharded.grad_agreement`)."""
        self.raise_if_destroyed("step()")
        if agree and self.exchanging() and (refused := self._kept_failure(self.agreement.now(
                "step()", gradients_digest(self.engine.parameters())))) is not None:
            raise refused

    def meet(self, call: str) -> None:
        """Before a collective ``call`` (``consolidate_state_dict()``, checkpoint save
        or load): refused where another rank started a backward or ``step()`` instead
        (:meth:`SettingsAgreement.meet`); nothing to meet at one rank, or once the
        exchange failed."""
        if self.exchanging():
            self.agreement.meet(call)

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if torch._C._current_graph_task_id() == -1 and self._scope.enter() == OUTSIDE:
            raise join_refusal()
        self.exchange.poll()  # updates that have arrived land between autograd nodes
        return super().run(bucket)

    def refuse_destroyed_group(self, what: str) -> OverlapkitError | None:
        """The refusal of ``what`` once the exchange's process group was destroyed
        (:func:`destroyed_group_refusal`), else None."""
        group = self.exchange.group
        if group is None or group in dist.distributed_c10d._world.pg_map:
            return None
        self.exchange.active = False  # nothing to send on: a refused backward sends nothing
        return destroyed_group_refusal(what)

    def raise_if_destroyed(self, what: str) -> None:
        """:raises ConfigurationError: :meth:`refuse_destroyed_group`'s refusal."""
        if (gone := self.refuse_destroyed_group(what)) is not None:
            raise gone

    def backward_starts(self) -> OverlapkitError | None:
        if (gone := self.refuse_destroyed_group("a backward")) is not None:
            return gone
        check = self.held_check() if self.held_check is not None else None
        changed = check() if check is not None else None
        if changed is not None:
            return changed
        refused = super().backward_starts()
        if refused is None:
            self.advance()
        return refused

    def _step_buckets(self, items: list[PendingBucket]) -> list[torch.Tensor]:
        self._settings_refused()
        buffers = super()._step_buckets(items)
        if self.per_bucket and self.reduction_error is None:
            # On every rank, whether or not it owns anything here, and whether or not
            # the step raised (it is raised at the end of backward): the broadcasts
            # must match across ranks, bucket by bucket in bucket order (however the
            # buckets were run together on each rank). On the steps' side stream,
            # right after them. Not after a failed reduction: the ranks are out of
            # step, and the error is raised at the end of backward.
            for (bucket, _), buffer in zip(items, buffers, strict=True):
                params = bucket.parameters()
                with self._on_side_stream(params):
                    if self.clipping.value is not None:
                        self._clamp_the_others(bucket, buffer, self.clipping.value)
                    self.exchange.launch_bucket(bucket.index(), params)
        return buffers

    def comm_failure(self) -> BaseException | None:
        """The failed reduction of this backward, else a failed broadcast of the
        exchange (kept by :meth:`ParameterExchange.poll`, which runs in the hook). A
        failed reduction fails the exchange too: the parameters are not all their
        owners' now, so every later wait for them (the next forward, ``step()``, the
        state dicts) raises it, instead of going on with them — the very error this
        backward raises, also where the settings check's all-reduce failed first and was
        kept (a peer killed mid-backward on a loaded machine: the next forward named
        "exchanging the updated parameters" where backward had named the bucket)."""
        reduction = super().comm_failure()
        if reduction is not None and not isinstance(reduction, ConfigurationError) and (
                gathering := self.agreement.peer_gathering("backward()")) is not None:
            gathering.__cause__ = reduction  # it waited for a peer gathering the state
            reduction = self.reduction_error = gathering
        failed = reduction or self.exchange.failure
        if reduction is not None or self.exchange.failure is None:
            self.exchange.failure = failed
        return failed

    def _clamp_the_others(self, bucket: dist.GradBucket, buffer: torch.Tensor,
                          value: float) -> None:
        """Clamp the reduced gradients of the bucket's parameters other ranks step,
        as this rank's were before their step: ``.grad`` then reads as after the
        plain loop's ``clip_grad_value_`` on every parameter (DDP copies the bucket
        into ``.grad`` after backward), not only on this rank's share."""
        with torch.no_grad():
            for grad in self.layouts.get(bucket, buffer).others:
                grad.clamp_(min=-value, max=value)

    def _after_backward(self) -> None:
        self._settings_refused()  # (nothing stepped in backward: deferred, global steps)
        try:
            super()._after_backward()
        finally:
            if not self.per_bucket:
                # the steps were taken here (and synchronised): exchange them all
                self.exchange.launch_all()
            # When backward() returns every parameter holds its update, as without
            # sharding: a loop may read them before the next forward (an EMA of the
            # weights, logging) without calling step(). Only the last buckets' exchange
            # is left to wait for here; the others landed while backward went on. On
            # an accelerator this enqueues the waits and copies (no host wait).
            self.wait_for_parameters()
            marks = self.stepped_marks
            if marks is not None:  # the exchange wrote parameters after they were marked
                marks.versions = {id(p): p._version for p in self.engine.parameters()}

    def wait_for_parameters(self) -> None:
        """Every update exchanged so far has landed, and (on an accelerator) the current
        stream waits for it: call before reading parameters."""
        self.exchange.wait()
        self.synchronize()

    def before_forward(self) -> None:
        """Before each forward of the DDP model: every parameter holds its last update
        (waiting for the exchange if it has not arrived), then what
        :meth:`BucketStepper.before_forward` does."""
        self.exchange.wait()
        super().before_forward()

    def full_step_taken(self) -> None:
        """A ``step()`` with no stepping backward before it stepped this rank's share:
        exchange it, and wait (the plain ``step()`` returns with the parameters
        updated)."""
        self.advance()
        self.exchange.launch_all()
        self.wait_for_parameters()
