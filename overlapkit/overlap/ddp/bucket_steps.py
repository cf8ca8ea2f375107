"""How reduced gradient buckets are stepped: one or several at a time, in one call of
the engine, on the side stream where there is one.

The base of :class:`~overlapkit.overlap.ddp.bucket_stepper.BucketStepper`, which decides
*when* buckets are stepped; this module is *how*. Several consecutive buckets whose
reductions have completed are stepped together, with one engine call: the cost of a
call (the optimizer's Python around its arithmetic, the lookup of each parameter's
state) is paid per call, not per bucket, which was most of the per-bucket cost of the
overlap on CPU (measured on torch 2.13, see ``docs/benchmarks.md``). The parameters
each bucket steps, their gradients as views of the bucket and the engine's grouping of
them are worked out once per bucket layout and per run of buckets
(:class:`~overlapkit.overlap.core.bucket_layout.BucketLayouts`), not per step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.overlap.core.bucket_layout import BucketLayouts
from overlapkit.overlap.core.closures import closure_needed
from overlapkit.overlap.core.engine import OverlapEngine, StepPlan
from overlapkit.overlap.core.side_stream import SideStream
from overlapkit.overlap.ddp.failed_reductions import FailedReductions
from overlapkit.overlap.ddp.filled_grads import FilledGradients
from overlapkit.overlap.ddp.replaced_buffers import call_hook, original_buffer
from overlapkit.overlap.rules.clipping import GradClipping

__all__ = ["BucketSteps", "PendingBucket"]

#: a bucket whose reduction was launched, and the reduction's future
PendingBucket = tuple[dist.GradBucket, "torch.futures.Future[Any]"]

#: entered where a step runs inline (no side stream): stateless, so shared
_INLINE = nullcontext()


class BucketSteps(FailedReductions):
    """Steps the owned parameters of reduced buckets (set up by the bucket stepper)."""

    engine: OverlapEngine
    layouts: BucketLayouts
    clipping: GradClipping
    side_stream: SideStream | None
    track_usage: bool
    grads_are_bucket_views: bool
    free_grads: bool
    #: parameters that got a gradient on this rank since the last synced backward
    used: set[torch.Tensor]
    #: bucket index -> the owned parameters stepped with it, last backward
    last_buckets: dict[int, list[torch.Tensor]]
    #: the first error a step raised during this backward; raised when it ends
    _step_error: BaseException | None
    #: no side stream: steps run inline, on the thread that asks
    _inline: bool
    _clips: bool
    #: the own .grad of parameters stepped while later reductions were in flight,
    #: filled then (``fills_grads``), so that DDP's finalize need not copy them
    filled_grads: FilledGradients
    fills_grads: bool = False
    #: the hooks set up for it on the model and its parameters (see :meth:`remove`)
    handles: list[Any]
    #: called by :meth:`remove` to stop the model's comm hook running this stepper
    #: (set at set-up: :class:`~overlapkit.overlap.ddp.setup.CommHookSlot`)
    unbind: Callable[[], None] | None = None

    def remove(self) -> None:
        """Stop stepping during backward (``release()``, or replaced by a later call):
        the model's comm hook no longer runs this stepper (it reduces as the comm hook
        alone would, or runs the stepper that replaced it), and its hooks are removed."""
        if self.unbind is not None:
            self.unbind()
            self.unbind = None
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _step(self, params: list[torch.Tensor]) -> None:
        """Step ``params`` whose gradients the compute stream produced (the side stream
        waits for it first)."""
        plan = self.engine.plan(params)
        if self._inline:
            self._apply_step(plan)
            return
        with self.side_stream.running(params):  # type: ignore[union-attr]
            self._apply_step(plan)

    def _apply_step(self, plan: StepPlan) -> None:
        if self._clips:
            self.clipping.apply(plan.params)
        self.engine.step_plan(plan)

    def _on_side_stream(self, params: list[torch.Tensor]) -> Any:
        """The side stream of the buckets' device, entered without waiting for the
        compute stream: the steps wait for the comm futures in it instead (the
        allreduce already waited for the gradients)."""
        if self._inline:
            return _INLINE
        return self.side_stream.running(params, after_compute=False)  # type: ignore[union-attr]

    def call_hook(self, bucket: dist.GradBucket) -> torch.futures.Future[Any]:
        """Run the inner comm hook on ``bucket`` (:mod:`.replaced_buffers`: a hook that
        replaces the bucket's buffer is stepped from DDP's)."""
        return call_hook(self, bucket)

    def _step_bucket(self, bucket: dist.GradBucket,
                     future: torch.futures.Future[Any]) -> torch.Tensor:
        """Step one bucket (see :meth:`_step_buckets`); its reduced buffer."""
        return self._step_buckets([(bucket, future)])[0]

    def _step_buckets(self, items: list[PendingBucket]) -> list[torch.Tensor]:
        """Step the owned parameters of each bucket of ``items`` (consecutive, in bucket
        order) with its reduced gradients, in one call of the engine; the buckets'
        reduced buffers.

        Never raises: an error of the step (an optimizer or a step hook raising) is
        kept and raised at the end of backward, and the buckets after it are reduced
        but not stepped. Raising here, inside DDP's comm hook, would abort backward on
        this rank after some reductions only, while the other ranks launch a different
        number: every later collective would hang. A failed reduction is kept the same
        way (:meth:`reduced`), and nothing after it is stepped.
        """
        params = items[0][0].parameters() if len(items) == 1 else \
            [param for bucket, _ in items for param in bucket.parameters()]
        # On the side stream, as PyTorch's own optimizer-overlap hook does: waiting for
        # an NCCL future makes the *current* stream wait for the allreduce, and only
        # the side stream may (the compute stream goes on with backward).
        with self._on_side_stream(params):
            buffers: list[torch.Tensor] = []
            reduced: list[tuple[dist.GradBucket, torch.Tensor]] = []
            #: (a future's tensor of its own, the bucket it was copied into)
            results: list[tuple[torch.Tensor, torch.Tensor]] = []
            for bucket, future in items:
                buffer = original_buffer(self, bucket)
                result = (self.hook_result(future.value(), buffer, bucket.index())
                          if self.reduced(future, bucket.index()) else None)
                if result is not None:
                    if result.data_ptr() != buffer.data_ptr():
                        buffer.copy_(result)
                        results.append((result, buffer))
                    reduced.append((bucket, buffer))
                buffers.append(buffer)  # else: raised when backward ends
            if reduced and self._step_error is None:
                try:
                    self._step_reduced(reduced)
                except Exception as error:  # held until backward ends; see the docstring
                    self._step_error = closure_needed(error)
                if results and self._clips:
                    # DDP's finalize copies the future's tensor into .grad: it gets the
                    # clipped gradients the step used, as .grad after the plain clip
                    for result, buffer in results:
                        result.copy_(buffer)
        return buffers

    def _step_reduced(self, reduced: list[tuple[dist.GradBucket, torch.Tensor]]) -> None:
        layouts = self.layouts
        parts = [layouts.get(bucket, buffer) for bucket, buffer in reduced]
        if len(parts) == 1:
            step: Any = parts[0]
        else:
            step = layouts.batch(tuple(bucket.index() for bucket, _ in reduced), parts)
        chosen, views, plan = step.owned, step.views, step.plan
        if self.track_usage:  # only the parameters used since the last synced backward
            used = self.used
            stepped, views = [], []
            for part in parts:
                kept = [(p, v) for p, v in zip(part.owned, part.views, strict=True)
                        if p in used]
                stepped.append([p for p, _ in kept])
                views += [v for _, v in kept]
            chosen = [p for params in stepped for p in params]
            plan = self.engine.plan(chosen)
        else:
            stepped = [part.owned for part in parts]
        for (bucket, _), params in zip(reduced, stepped, strict=True):
            self.last_buckets[bucket.index()] = params
        # gradient_as_bucket_view=True: DDP has made each used .grad a view of the
        # bucket. False: .grad is still the local gradient (DDP copies the reduced
        # one into it after backward), so the reduced view is lent for the step.
        # With free_grads the view stays: the local gradient is freed now, and
        # DDP's copy after backward is a copy of the bucket onto itself.
        restore: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        if not self.grads_are_bucket_views:
            if not self.free_grads:
                restore = [(param, param.grad) for param in chosen]
            for param, grad in zip(chosen, views, strict=True):
                param.grad = grad
        try:
            if self._clips:  # each bucket by itself (clip_grad_norm_scope="bucket")
                for params in stepped:
                    self.clipping.apply(params)
            if chosen:
                self.engine.step_plan(plan)  # already on the side stream
            if restore and self.fills_grads:
                self.filled_grads.fill(restore, views)
        finally:
            for param, local_grad in restore:
                param.grad = local_grad
