"""Per-parameter steps during backward: :class:`ParamStepper`, for plain modules and
FSDP2 (``fully_shard``) models.

Each parameter gets a post-accumulate-grad hook that clips and steps exactly that
parameter as soon as its gradient is complete, then sets ``.grad`` to None, so the
gradient's memory is free before backward ends. Where the hook fires (measured on
torch 2.13):

- a plain module: autograd calls it once the parameter's gradient has been accumulated
  (every use of the parameter in the graph has contributed);
- an FSDP2 model: the hooks are registered on the sharded (DTensor) parameters, which
  autograd never sees; FSDP2 calls them itself right after the reduce-scatter of the
  parameter's group has written the sharded gradient (``foreach_reduce`` in
  ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``), on an accelerator
  with its post-reduce stream current. So the step sees the reduced, sharded gradient.

On CPU (no side stream) the thread that steps is the one that computes backward, so a
step between two of backward's kernels only moves work, and each engine call costs its
Python and the optimizer's grouping again: 400 one-parameter steps took 1.19-1.28 x the
plain ``step()`` (``overlapkit bench --only engine_overhead``, ``docs/benchmarks.md``).
There the parameters whose gradients are complete are collected and stepped together,
in one engine call, once they hold :data:`BATCH_BYTES` of gradient, and at the end of
backward: at most that much gradient more is alive at a time than with a step per
parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.hooks import RemovableHandle

from overlapkit.overlap.core.backward_scope import NEW, OUTSIDE, BackwardScope
from overlapkit.overlap.core.engine import OverlapEngine, StepPlan
from overlapkit.overlap.core.side_stream import SideStream
from overlapkit.overlap.core.step_accounting import StepAccount
from overlapkit.overlap.rules.clipping import GradClipping
from overlapkit.overlap.rules.global_step import GlobalStep

__all__ = ["BATCH_BYTES", "ParamStepper"]

#: on CPU, the gradient bytes collected before the parameters are stepped together
BATCH_BYTES = 4 << 20
#: batches whose plans are kept (a backward in the same order each time needs a few)
_KEPT_BATCH_PLANS = 64


class ParamStepper(StepAccount):
    """Steps each parameter of ``engine`` from its post-accumulate-grad hook.

    :param engine: steps the parameters.
    :param clipping: applied to each parameter's gradient before its step.
    :param side_stream: where the steps run (inline on CPU).
    """

    def __init__(self, engine: OverlapEngine, *, clipping: GradClipping,
                 side_stream: SideStream, global_step: GlobalStep | None = None,
                 full_step: GlobalStep | None = None) -> None:
        super().__init__("optimizer_in_backward", "inside `with optimizer.no_step():`")
        self.engine = engine
        #: set when steps wait for a global decision (global norm clipping, a
        #: GradScaler): gradients are kept, everything steps at the end of backward
        self.global_step = global_step
        #: what a step() after backwards that stepped nothing applies (step_rules)
        self.full_step = full_step
        self.clipping = clipping
        self.side_stream = side_stream
        # read per parameter: worked out once (a CPU run has no side stream)
        self._inline = not side_stream.active
        # id(param) -> its StepPlan (which holds the parameter, so the id stays its own)
        self._plans: dict[int, StepPlan] = {}
        #: inline: parameters whose gradient is complete, not stepped yet, and their bytes
        self._batch: list[torch.Tensor] = []
        self._batch_bytes = 0
        # the ids of a batch's parameters -> its StepPlan (which holds them)
        self._batch_plans: dict[tuple[int, ...], StepPlan] = {}
        #: while true, gradients accumulate and nothing is stepped (no_step())
        self.paused = False
        self.handles: list[RemovableHandle] = []
        # which backward a hook runs in (nested reentrant-checkpointing backwards
        # belong to the outer one); its end runs _after_backward
        self._scope = BackwardScope(self._after_backward)
        #: owned parameters that had requires_grad=False at set-up (no hook yet):
        #: hooked at the next forward if unfrozen since (see :meth:`hook_unfrozen`)
        self.frozen: list[torch.Tensor] = []
        #: the first error a step raised during this backward; raised when it ends
        self._step_error: BaseException | None = None

    def register(self, params: Iterable[torch.Tensor]) -> None:
        """Add the hook to each of ``params``; frozen ones (``requires_grad=False``,
        where torch refuses a hook) are kept aside until they are unfrozen."""
        for param in params:
            if param.requires_grad:
                self.handles.append(param.register_post_accumulate_grad_hook(self._on_grad))
            else:
                self.frozen.append(param)

    def hook_unfrozen(self) -> None:
        """Hook the frozen parameters that have been unfrozen since; called before each
        forward of the model while any is frozen, so the forward about to build the
        graph already sees the hook: the unfrozen parameter is stepped from this
        backward on, exactly as the plain optimizer (which holds it too) would step it."""
        unfrozen = [p for p in self.frozen if p.requires_grad]
        if unfrozen:
            self.frozen = [p for p in self.frozen if not p.requires_grad]
            self.register(unfrozen)

    def remove(self) -> None:
        """Remove every hook: from now on, nothing steps during backward."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _on_grad(self, param: torch.Tensor) -> None:
        grad = param.grad
        if self.paused or grad is None or not self.engine.owns(param):
            # not owned: removed from the optimizer (load_state_dict, param_groups
            # edited); its gradient is left alone
            return
        entered = self._scope.enter()
        if entered == NEW:
            # a second stepping backward with no step() in between, in a loop that
            # calls step(), is refused: nothing is stepped in it (step_accounting); on
            # FSDP2 every reduce-scatter still runs
            self._step_error = self.starting_backward()
            # a batch left by a backward that raised before its end is not stepped
            self._batch, self._batch_bytes = [], 0
        if self.deferring:
            return  # defer_steps(): the gradient is kept for step()'s full step
        in_backward = entered != OUTSIDE
        if in_backward and self._step_error is not None:
            return  # a step of this backward raised: the rest keep their gradients
        if self.global_step is not None and in_backward:
            return  # stepped with every other gradient at the end of backward
        if not in_backward:
            # outside autograd (a hook called by hand): one step, finished here
            self.stepped_since_step = self.has_stepped = True
        elif self._inline:
            self._batch.append(param)
            self._batch_bytes += grad.numel() * grad.element_size()
            if self._batch_bytes >= BATCH_BYTES:
                self._step_batch()
            return
        try:
            plan = self._plan_of(param)
            if self._inline:
                self._step(plan)
            else:
                with self.side_stream.running(plan.params, freed=(grad,)):
                    self._step(plan)
        except Exception as error:
            if not in_backward:
                raise
            # Held until backward ends, as the bucket stepper does: on FSDP2 this
            # hook runs between reduce-scatters, and raising here would stop this
            # rank's backward after fewer collectives than the other ranks run.
            self._step_error = error
            return
        param.grad = None
        del grad
        if not in_backward:
            self._after_backward()

    def _plan_of(self, param: torch.Tensor) -> StepPlan:
        """The engine's plan of stepping ``param`` alone, made once per layout."""
        plan = self._plans.get(id(param))
        if plan is None or plan.version != self.engine.layout_version:
            plan = self._plans[id(param)] = self.engine.plan([param])
        return plan

    def _step(self, plan: StepPlan) -> None:
        if self.clipping.enabled:
            self.clipping.apply(plan.params)
        self.engine.step_plan(plan)

    def _step_batch(self) -> None:
        """Step the collected parameters (inline, in backward) in one engine call, each
        clipped by itself first, then free their gradients. An error is kept until
        backward ends, and the batch keeps its gradients."""
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        if not batch:
            return
        key = tuple(map(id, batch))
        plan = self._batch_plans.get(key)
        if plan is None or plan.version != self.engine.layout_version:
            if len(self._batch_plans) >= _KEPT_BATCH_PLANS:
                self._batch_plans.clear()  # backwards in ever new orders
            plan = self._batch_plans[key] = self.engine.plan(batch)
        try:
            if self.clipping.enabled:
                for param in batch:
                    self.clipping.apply([param])
            self.engine.step_plan(plan)
        except Exception as error:  # held until backward ends (see _on_grad)
            self._step_error = error
            return
        for param in batch:
            param.grad = None

    def synchronize(self) -> None:
        """Make the compute stream wait for every step enqueued so far (no-op inline)."""
        self.side_stream.join()

    def _after_backward(self) -> None:
        if self._step_error is None:
            self._step_batch()
        self._batch, self._batch_bytes = [], 0
        error, self._step_error = self._step_error, None
        if error is None and self.global_step is not None and not self.deferring:
            owned = self.engine.parameters()
            with self.side_stream.running(owned):
                self.global_step.step(self.engine, owned)
            for param in owned:
                param.grad = None
        self.side_stream.join()
        if error is not None:
            self.backward_refused()  # the loop learns of it here, not at step()
            raise error
        if self.deferring:
            self.deferred_backward_ended(self.engine.parameters())
        else:
            self.stepped_backward_ended(self.engine.parameters())
