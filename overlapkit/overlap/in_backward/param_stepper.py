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

On CPU the parameters are stepped in batches instead
(:mod:`~overlapkit.overlap.in_backward.param_batch`).

Under reentrant activation checkpointing each checkpointed segment runs a backward of
its own, and a parameter used in several segments (shared weights) is accumulated, and
its hook called, once per segment. On CPU the batches are then not stepped before the
end of backward, so such a parameter is stepped once, with its whole gradient; a hook
called again for a parameter already stepped in the same backward (on an accelerator,
or where the parameter was stepped before the first nested segment) cannot be undone,
and backward raises a :class:`~overlapkit.errors.ConfigurationError` saying so.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.hooks import RemovableHandle

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.core.backward_scope import NEW, OUTSIDE, BackwardScope
from overlapkit.overlap.core.closures import closure_needed
from overlapkit.overlap.core.engine import OverlapEngine, StepPlan
from overlapkit.overlap.core.hook_order import OwnHooksLast
from overlapkit.overlap.core.side_stream import SideStream
from overlapkit.overlap.core.step_accounting import StepAccount
from overlapkit.overlap.in_backward.param_batch import ParamBatch
from overlapkit.overlap.rules.clipping import GradClipping
from overlapkit.overlap.rules.global_step import GlobalStep

__all__ = ["ParamStepper"]


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
        #: inline: the parameters whose gradient is complete, not stepped yet
        self._batch = ParamBatch(engine, clipping)
        #: id of each parameter whose hook ran in the backward under way
        self._seen: set[int] = set()
        #: while true, gradients accumulate and nothing is stepped (no_step())
        self.paused = False
        self.handles: list[RemovableHandle] = []
        #: the step hooks, moved behind hooks the loop registers later (before_forward)
        self._own_hooks = OwnHooksLast()
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
                handle = param.register_post_accumulate_grad_hook(self._on_grad)
                self.handles.append(handle)
                self._own_hooks.add(param, handle)
            else:
                self.frozen.append(param)

    def hook_unfrozen(self) -> None:
        """Hook the frozen parameters that have been unfrozen since; called before each
        forward of the model while any is frozen (:meth:`before_forward`), so the
        forward about to build the graph already sees the hook: the unfrozen parameter
        is stepped from this backward on, exactly as the plain optimizer (which holds
        it too) would step it."""
        unfrozen = [p for p in self.frozen if p.requires_grad]
        if unfrozen:
            self.frozen = [p for p in self.frozen if not p.requires_grad]
            self.register(unfrozen)

    def before_forward(self) -> None:
        """Before each forward of the model (one forward pre-hook):

        - after a backward that raised before its end: close its scope
          (:meth:`BackwardScope.close_if_stale`), and drop the batch it left (CPU), with
          its gradients, before the next backward accumulates onto them (the plain
          loop's ``zero_grad()`` after a caught error); nothing during a backward, where
          a checkpointed forward is recomputed. On an accelerator, join the side stream
          whose end-of-backward join did not run: the forward (FSDP2: its all-gather)
          reads the parameters;
        - hook the frozen parameters unfrozen since (:meth:`hook_unfrozen`);
        - keep the step hooks behind any post-accumulate-grad hook the loop registered
          since (:mod:`~overlapkit.overlap.core.hook_order`): that hook sees the
          gradient before it is stepped and freed, as before the plain ``step()``."""
        self._scope.close_if_stale()
        if self._batch and torch._C._current_graph_task_id() == -1:
            self._batch.drop(keep_grads=False)
        self.synchronize()
        if self.frozen:
            self.hook_unfrozen()
        self._own_hooks.keep_last()

    def zero_grad_called(self) -> None:
        super().zero_grad_called()
        self._batch.drop(keep_grads=True)  # the gradients are the loop's to clear

    def remove(self) -> None:
        """Remove every hook: from now on, nothing steps during backward."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._own_hooks.clear()

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
            if self._batch.added_to(param) and self._step_error is None:
                self._step_error = _added_to_leftover(param)
            self._batch.drop(keep_grads=False)  # left by a backward that raised
            self._seen = set()
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
            self._batch.drop(keep_grads=False)  # left by a backward that raised
        elif id(param) in self._seen:
            if param not in self._batch:  # stepped with part of its gradient
                self._step_error = _accumulated_again(param)
            return  # else its .grad holds the sum, stepped with its batch
        else:
            self._seen.add(id(param))
            if self._inline:
                # reentrant checkpointing may add to a parameter until backward ends
                if self._batch.add(param, grad) and not self._scope.nested:
                    self._step_error = self._batch.step()
                return
        try:
            plan = self._plan_of(param)
            if self._inline:
                self._step(plan)
            else:
                with self.side_stream.running(plan.params, freed=(grad,)):
                    self._step(plan)
        except Exception as raised:
            error = closure_needed(raised)
            if not in_backward and error is raised:
                raise
            if not in_backward:
                raise error from raised
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

    def synchronize(self) -> None:
        """Make the compute stream wait for every step enqueued so far (no-op inline)."""
        self.side_stream.join()

    def _after_backward(self) -> None:
        if self._step_error is None:
            self._step_error = self._batch.step()
        self._batch.drop(keep_grads=True)  # a step of this backward raised: kept
        self._seen = set()
        error, self._step_error = self._step_error, None
        held = False
        if error is None and self.global_step is not None and not self.deferring:
            owned = self.engine.parameters()
            with self.side_stream.running(owned):
                self.global_step.step(self.engine, owned, hold_nonfinite=self.calls_step)
            held = self.global_step.held  # a non-finite norm: step() or zero_grad() decides
            for param in owned if not held else ():
                param.grad = None
        self.side_stream.join()
        if error is not None:
            self.backward_refused()  # the loop learns of it here, not at step()
            raise error
        if self.deferring:
            self.deferred_backward_ended(self.engine.parameters())
        elif held:
            self.backward_stepped_nothing()
        else:
            self.stepped_backward_ended(self.engine, freed=True)


def _accumulated_again(param: torch.Tensor) -> ConfigurationError:
    return ConfigurationError(
        f"a parameter of shape {tuple(param.shape)} got more of its gradient after it "
        "was stepped, in the same backward: its post-accumulate-grad hook ran again. "
        "Reentrant activation checkpointing (checkpoint(..., use_reentrant=True)) runs "
        "a backward per checkpointed segment, and a parameter used in several segments "
        "(shared weights), or inside and outside one, is accumulated once per segment; "
        "it was stepped with the first part only, so this step differs from the plain "
        "loop's. Use checkpoint(..., use_reentrant=False), which accumulates the whole "
        "gradient first, or the plain optimizer for this model."
    )


def _added_to_leftover(param: torch.Tensor) -> ConfigurationError:
    return ConfigurationError(
        f"a backward raised before its end and left the gradient of a parameter of shape "
        f"{tuple(param.shape)} unstepped; this backward added its own gradient to it, "
        "so stepping it would use both. Nothing is stepped in this backward. Call "
        "optimizer.zero_grad() after catching an error raised by backward (the plain "
        "loop needs it too), or run the model's forward before the next backward "
        "(overlapkit drops such gradients there)."
    )
