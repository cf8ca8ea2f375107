"""The DDP comm hook that steps each gradient bucket once its reduction completes.

Shared by :func:`overlapkit.overlap_ddp` and :func:`overlapkit.optimizer_in_backward`
(for a DDP model): :mod:`overlapkit.overlap.ddp.setup` checks the model and registers a
comm hook that runs a :class:`BucketStepper` (:meth:`BucketStepper.run`). This module is
what runs per bucket during backward; nothing here runs at set-up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from overlapkit.comm_hooks import allreduce_hook, launch_allreduce
from overlapkit.overlap.core.backward_scope import NEW, OUTSIDE, BackwardScope
from overlapkit.overlap.core.bucket_layout import BucketLayouts, bucket_gradient_views
from overlapkit.overlap.core.engine import OverlapEngine
from overlapkit.overlap.core.side_stream import SideStream
from overlapkit.overlap.core.window import clear_stepped
from overlapkit.overlap.ddp import inline_schedule as inline
from overlapkit.overlap.ddp.bucket_steps import BucketSteps, PendingBucket
from overlapkit.overlap.ddp.comm_threads import COMM_THREADS
from overlapkit.overlap.ddp.filled_grads import FilledGradients
from overlapkit.overlap.ddp.param_hooks import free_local_grads_once_bucketed, refuse_unfrozen
from overlapkit.overlap.ddp.unreduced import UnreducedGradients
from overlapkit.overlap.rules.clipping import GradClipping
from overlapkit.overlap.rules.global_step import GlobalStep

__all__ = ["STEP_THREADS", "BucketStepper", "bucket_gradient_views"]

#: where bucket steps run: see overlap_ddp(step_thread=...)
STEP_THREADS = ("backward", "comm")


class BucketStepper(BucketSteps):
    """The state of the registered comm hook: runs the inner hook, then steps.

    ``step_thread="backward"``: buckets are stepped on the thread running backward.

    - With a side stream (an accelerator), a bucket whose reduction has completed
      is stepped at the next bucket's hook: the step is enqueued on the side stream
      and runs on the device beside backward's kernels.
    - Inline (CPU), the thread that steps is the one that computes backward, so a step
      between two hooks only delays backward, and the reductions launched after it.
      Buckets are stepped once backward's computation is done, just before DDP
      finalises it, while the reductions still in flight complete: every bucket
      whose reduction has completed is stepped at once, in one call of the engine,
      then the next one is waited for (:meth:`_drain`). On one rank, or where the
      reductions keep up with backward, that is one call for the whole model, as
      the plain ``step()``; where communication is slower, the steps fill the wait
      for it.

    ``"comm"``: in the future's callback, which runs on a gloo worker thread
    concurrently with autograd (measured on torch 2.13). Either way the stepping
    goes through the engine's lock, and every bucket has been stepped when
    ``backward()`` returns.

    ``free_grads``: the stepped parameters' ``.grad`` are set to None once DDP has
    finalised backward (see :meth:`_step_reduced` for what that frees, and when).

    Under ``ddp_model.join()`` (uneven inputs) a rank that has run out of inputs
    only runs the inner hook on DDP's zero-filled shadow buckets, outside any
    backward: it has no gradient to step.
    """

    def __init__(
        self,
        engine: OverlapEngine,
        inner_state: Any,
        inner_hook: Any,
        *,
        track_usage: bool,
        step_thread: str,
        grads_are_bucket_views: bool,
        clipping: GradClipping,
        free_grads: bool = False,
        side_stream: SideStream | None = None,
        global_step: GlobalStep | None = None,
        full_step: GlobalStep | None = None,
        technique: str = "overlap_ddp",
        static_graph: bool = False,
    ) -> None:
        super().__init__(technique, "inside `with ddp_model.no_sync():`")
        self.engine = engine
        self.inner_state = inner_state
        self.inner_hook = inner_hook
        self.track_usage = track_usage
        self.step_thread = step_thread
        self.grads_are_bucket_views = grads_are_bucket_views
        self.clipping = clipping
        self.free_grads = free_grads
        self.side_stream = side_stream
        # read per bucket: worked out once (a CPU run has no side stream)
        self._inline = side_stream is None or not side_stream.active
        #: inline with the ``allreduce`` hook: the reduction is launched here and DDP
        #: is answered with a future of this stepper's (see _launch). Not with
        #: static_graph: DDP runs every hook of its first backward inside its own
        #: end-of-backward callback and waits for the futures there, before this
        #: stepper's end of backward could answer them (it hung, measured).
        self._answers_itself = (self._inline and inner_hook is allreduce_hook
                                and step_thread == "backward" and not static_graph)
        #: averages each bucket where plain DDP divides gradients kept as bucket views
        #: (set at set-up: :mod:`~overlapkit.overlap.ddp.kept_gradients`)
        self.average: Callable[[dist.GradBucket, int], None] | None = None
        #: bucket index -> the future DDP holds for it, completed once it is stepped
        self._answers: dict[int, torch.futures.Future[torch.Tensor]] = {}
        #: inline: the order of the steps at the end of backward
        self.schedule = inline.InlineSchedule()
        self._clips = clipping.enabled
        #: what is known of each bucket from the backwards before
        self.layouts = BucketLayouts(engine)
        self.model_before_rebuild: Callable[[], DistributedDataParallel | None] | None = None
        #: set when steps wait for a global decision (global norm clipping, a
        #: GradScaler): buckets are only reduced, everything steps after finalize
        self.global_step = global_step
        #: what a step() after backwards that stepped nothing applies (step_rules)
        self.full_step = full_step
        #: bucket index -> the owned parameters stepped with it, last backward
        self.last_buckets: dict[int, list[torch.Tensor]] = {}
        #: parameters that got a gradient on this rank since the last synced backward
        self.used: set[torch.Tensor] = set()
        # which backward a bucket's hook runs in (nested reentrant-checkpointing
        # backwards belong to the outer one); its end runs _before_finalize
        self._scope = BackwardScope(self._before_finalize)
        #: (name, parameter) of owned parameters frozen when DDP was built, so never
        #: reduced (set at set-up; see before_forward)
        self.frozen: list[tuple[str, torch.Tensor]] = []
        #: stepped gradients kept in .grad: a backward-only loop's next forward clears them
        self._stepped_grads_kept = False
        #: when parameters free their local gradient once copied (ddp.setup; weak refs)
        self.free_after_copy_model: Callable[[], DistributedDataParallel | None] | None = None
        #: those freed local gradients whose bucket has not run in this backward
        self.unreduced = UnreducedGradients(self.backward_refused, technique)
        self._pending: deque[PendingBucket] = deque()
        self.filled_grads = FilledGradients()
        #: the first error a step raised during this backward; raised when it ends
        self._step_error: BaseException | None = None
        #: note each bucket's parameters until DDP has rebuilt its buckets (set at set-up
        #: where it will), for checkpoints (rebuilt_layout)
        self.recording_layout = False
        self._seen_buckets: dict[int, list[torch.Tensor]] = {}
        #: DDP's parameters bucket by bucket since it rebuilt its buckets, saved with
        #: checkpoints so that a resumed run lays them out the same
        #: (overlapkit.checkpoint.ddp_buckets); None until known
        self.rebuilt_layout: list[list[torch.Tensor]] | None = None
        #: set while a checkpoint load replays that layout: nothing reduced or stepped
        self.replaying = False
        self.handles: list[Any] = []  # (see remove())

    # -- on the autograd thread -------------------------------------------------

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self.unreduced.reduced(bucket)  # DDP ran this bucket's hook, whatever comes of it
        if self.replaying:  # a backward of zeros that only lays the buckets out
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        entered = self._scope.enter()
        if entered == OUTSIDE:
            # No backward: a rank joined under DDP.join() shadows each bucket's
            # reduction with zeros (DistributedDataParallel._match_all_reduce_for_bwd_pass
            # in torch 2.13), where queue_callback would raise "Final callbacks can
            # only be installed during backward pass". Reduce only, step nothing.
            return self.inner_hook(self.inner_state, bucket)
        if entered == NEW:
            # buckets of a backward that raised before its end are not stepped
            self._pending.clear()
            self._answers.clear()
            self.filled_grads.give_back(recovering=True)
            # a second stepping backward with no step() in between, in a loop that
            # calls step(), is refused: nothing is stepped in it, every bucket is still
            # reduced (step_accounting). The scope queued _before_finalize for its end:
            # DDP queues its own finalize after the last bucket's hook, so ours (queued
            # now) runs first.
            self._step_error = self.starting_backward()
        if self.recording_layout:
            self._seen_buckets[bucket.index()] = bucket.parameters()
        if self._answers_itself and self.global_step is None and not self.deferring:
            return self._launch(bucket)
        future = self.call_hook(bucket)  # a hook replacing the buffer: DDP's kept
        if self.global_step is not None or self.deferring:
            # reduced now; stepped with every other after finalize, or (defer_steps())
            # left in .grad by DDP's finalize for step()'s full step
            return self.keep(future)
        if self.step_thread == "comm":
            return self.keep(future.then(lambda fut: self._step_bucket(bucket, fut)))
        self._pending.append((bucket, future))
        if not self._inline:  # inline, buckets wait for backward's end (class docstring)
            self._drain(wait=False)
        return future

    def _drain(self, wait: bool) -> None:
        """Step the pending buckets whose reduction has completed, in bucket order;
        with ``wait``, every pending bucket.

        With a side stream, one bucket at a time, as each is enqueued. Inline, at the
        end of backward: in the order :attr:`schedule` gives where reductions are still
        in flight (:mod:`~overlapkit.overlap.ddp.inline_schedule`, which the time
        spent blocked here informs).
        """
        pending = self._pending
        if not self._inline:
            while pending and (wait or pending[0][1].done()):
                self._step_run([pending.popleft()])  # waits on the side stream
            return
        if not wait:
            return
        if all(future.done() for _, future in pending):
            self._step_run(list(pending))  # everything reduced: one call
            pending.clear()
            return
        COMM_THREADS.refresh()
        blocked = [0.0, 0.0]  # wall and communication threads' CPU seconds waiting
        order = self.schedule.order(lambda: inline.mean_bucket_bytes(pending))
        spin = self.schedule.spins
        if order == inline.AFTER:
            for _, future in pending:
                inline.block_on(future, blocked, spin)
        while pending:
            # wait for the next reduction, then take every bucket ready by then with it
            inline.block_on(pending[0][1], blocked, spin)
            run = [pending.popleft()]
            while pending and pending[0][1].done():
                run.append(pending.popleft())
            self.fills_grads = bool(pending)  # the rank waits next: fill .grad meanwhile
            self._step_run(run)
        self.fills_grads = False
        self.schedule.ended(*blocked)

    def _step_run(self, run: list[PendingBucket]) -> None:
        """Step a run of consecutive buckets, and answer DDP's futures for them."""
        buffers = self._step_buckets(run)
        answers = self._answers
        if answers:
            for (bucket, _), buffer in zip(run, buffers, strict=True):
                answers.pop(bucket.index()).set_result(buffer)

    def _launch(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Launch the bucket's reduction (the ``allreduce`` comm hook's), and answer DDP
        with a future of this stepper's, completed once the bucket is stepped, before
        DDP's finalize waits for it (:meth:`_drain`).

        The hook's own future would complete through a Python callback on gloo's thread,
        taking the GIL from the training thread (torch 2.13, 2 ranks on 2 cores: twice
        gloo's CPU time, +30 % on a step of 100 buckets; ``docs/benchmarks.md``).
        """
        launched = launch_allreduce(self.inner_state, bucket, self.average)
        if launched is None:  # one rank: the bucket is its own sum
            launched = torch.futures.Future()
            launched.set_result([bucket.buffer()])
        answer: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._answers[bucket.index()] = answer
        self._pending.append((bucket, launched))
        return answer

    def _before_finalize(self) -> None:
        self._drain(wait=True)
        self.raise_failed_reduction()  # a reduction failed: raised here (failed_reductions)
        # Before DDP's finalize, which copies the buckets back into .grad on the compute
        # stream, after the side stream's steps read (and clipping rewrote) the buckets.
        self.synchronize()
        self.filled_grads.lend()  # DDP's finalize, next, has nothing left to copy there
        Variable._execution_engine.queue_callback(self._after_backward)

    def synchronize(self) -> None:
        """Make the compute stream wait for every step enqueued so far (no-op inline)."""
        if self.side_stream is not None:
            self.side_stream.join()

    def _after_backward(self) -> None:
        self.filled_grads.give_back()
        model = self.model_before_rebuild() if self.model_before_rebuild else None
        if model is not None:
            # DDP rebuilds its buckets at the next forward, allocating the new ones
            # before it frees the old: layouts kept until then would keep every old
            # bucket alive through that forward (measured: +14 MiB of peak RSS per rank
            # on a 50 M-parameter model under optimizer_in_backward). So none is kept
            # until DDP says it has rebuilt them (once; torch 2.13's private flag).
            self.layouts.clear()
            if getattr(model, "_has_rebuilt_buckets", True):
                self.model_before_rebuild = None
                if self.recording_layout:  # this backward ran in the rebuilt buckets
                    self.rebuilt_layout = [self._seen_buckets[index]
                                           for index in sorted(self._seen_buckets)]
                    self.recording_layout = False
            self._seen_buckets = {}
        error, self._step_error = self._step_error, None
        if error is not None:
            # A step raised during this backward. It was held back until now, after
            # DDP's finalize, so that every bucket's reduction still ran on this rank
            # (ranks stay in step: the next collective, a barrier or a checkpoint
            # save, meets the same collectives on every rank, as with plain DDP whose
            # step() runs after backward). Buckets after the failing one were not
            # stepped; their gradients are kept.
            self.used.clear()
            self.backward_refused()  # the loop learns of it here, not at step()
            raise error
        if self.deferring:
            self.deferred_backward_ended(self.engine.parameters())
            return  # nothing stepped, nothing freed: step() takes the full step
        self._stepped_grads_kept = not self.free_grads
        if self.global_step is not None:
            self._step_globally()
            if self.global_step.held:  # a non-finite norm: step() or zero_grad() decides
                self._stepped_grads_kept = False
                self.backward_stepped_nothing()
                return
            self.stepped_backward_ended(self.engine, self.free_grads)
            return
        owned = self.engine.parameters() if self.track_usage or self.free_grads else []
        if self.track_usage:
            # find_unused_parameters: DDP knows which parameters were used on any rank
            # only in its finalize; the ones unused here were left for now and get
            # the gradient DDP finalised (None: unused everywhere, not stepped).
            unused = [p for p in owned if p not in self.used and p.grad is not None]
            self.used.clear()
            if unused:
                self._step(unused)
        self.synchronize()  # the unused parameters' steps just enqueued
        if self.free_grads:
            # After DDP's finalize, which would otherwise give a None .grad a fresh
            # copy of the bucket (gradient_as_bucket_view=False; measured).
            for param in owned:
                param.grad = None
        self.stepped_backward_ended(self.engine, self.free_grads)

    def _step_globally(self) -> None:
        """After DDP's finalize every reduced gradient is in ``.grad`` (unused ones
        None): unscale, check, clip and step them all, as plain DDP's step would."""
        owned = self.engine.parameters()
        self.used.clear()
        stream = self.side_stream
        with stream.running(owned) if stream is not None else nullcontext():
            self.global_step.step(  # type: ignore[union-attr]
                self.engine, owned, hold_nonfinite=self.calls_step)
        self.synchronize()
        if self.free_grads and not self.global_step.held:  # type: ignore[union-attr]
            for param in owned:
                param.grad = None

    def register(self, params: Iterable[torch.Tensor]) -> None:
        """Hook ``params`` (the engine's, at set-up or added later by
        ``add_param_group``): usage tracking and the early freeing of local
        gradients, where this stepper needs them. Frozen ones (``requires_grad=False``,
        never reduced by DDP) get no hook: see :meth:`before_forward`."""
        params = [p for p in params if p.requires_grad]
        if self.track_usage:
            for param in params:
                self.handles.append(param.register_post_accumulate_grad_hook(self.note_used))
        model = self.free_after_copy_model() if self.free_after_copy_model else None
        if model is not None:
            free_local_grads_once_bucketed(model, params)

    def before_forward(self) -> None:
        """Run before each forward of the DDP model (a forward pre-hook, always
        registered):

        - after a backward that raised: close its scope, and join a side stream
          whose end-of-backward join did not run;
        - refuse a frozen parameter of ``params`` that has been unfrozen: DDP decides
          at construction which parameters it reduces, so it never reduces that one's
          gradient and no bucket steps it — where the plain loop would step it on this
          rank's local gradient;
        - in a loop that has not called ``step()`` or ``zero_grad()`` after its last
          stepping backward (the backward-only loops of
          :mod:`~overlapkit.overlap.core.step_accounting`), clear the gradients that
          backward stepped, as the plain loop's ``zero_grad()`` would: the next backward
          would accumulate onto them, and DDP would reduce the sum; not under
          ``no_grad()`` (a validation: 0.4.0 refused it as a gradient change).
        """
        self._scope.close_if_stale()
        self.synchronize()
        if self.frozen:
            refuse_unfrozen(self.frozen, self.technique)
        if self._stepped_grads_kept and torch.is_grad_enabled():
            self._stepped_grads_kept = False
            if self.window and not self.calls_step:
                clear_stepped(self.stepped_marks, self.engine)

    def deferred(self) -> None:
        """Forget the usage the deferred backwards noted: their gradients are stepped by
        a full step, and the next stepping backward notes its own."""
        self.used.clear()

    def note_used(self, param: torch.Tensor) -> None:
        # Autograd calls post-accumulate-grad hooks with .grad None for a parameter
        # that only an unused output reaches (DDP's find_unused_parameters sink passes
        # undefined gradients through, e.g. BERT's pooler when the loss ignores it):
        # plain DDP leaves that .grad None and the optimizer skips it, so it is not
        # "used" here either (measured on torch 2.13).
        if param.grad is not None:
            self.used.add(param)

