"""On CPU, the parameters whose gradients are complete, stepped together.

Where there is no side stream (CPU), the thread that steps a parameter during backward
is the one computing backward, so a step between two of its kernels gains nothing; and
each call of the engine pays its Python and the optimizer's grouping again: 400
one-parameter steps took 1.21-1.28 x the plain ``step()`` (``overlapkit bench --only
engine_overhead``, ``docs/benchmarks.md``). So :class:`~overlapkit.overlap.in_backward.
param_stepper.ParamStepper` collects them here and steps them in one call per param
group once they hold :data:`BATCH_BYTES` of gradient, and the rest at the end of
backward: at most that much gradient is alive on top of one parameter's.
"""

from __future__ import annotations

import torch

from overlapkit.overlap.core.closures import closure_needed
from overlapkit.overlap.core.engine import OverlapEngine, StepPlan
from overlapkit.overlap.rules.clipping import GradClipping

__all__ = ["BATCH_BYTES", "ParamBatch"]

#: the gradient bytes collected before the parameters are stepped together
BATCH_BYTES = 4 << 20
#: batches whose plans are kept (a backward in the same order each time needs a few)
_KEPT_PLANS = 64


class ParamBatch:
    """Parameters whose gradients are complete and not stepped yet, with the gradient
    each had when it was added."""

    def __init__(self, engine: OverlapEngine, clipping: GradClipping) -> None:
        self.engine = engine
        self.clipping = clipping
        #: (parameter, its gradient when added, that gradient's version then)
        self._items: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._ids: set[int] = set()
        #: the gradient bytes collected
        self.bytes = 0
        # the ids of a batch's parameters -> a StepPlan per param group (each holds its
        # parameters, so the ids stay theirs)
        self._plans: dict[tuple[int, ...], list[StepPlan]] = {}

    def __contains__(self, param: torch.Tensor) -> bool:
        return id(param) in self._ids

    def __len__(self) -> int:
        return len(self._items)

    def add(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """Collect ``param``; whether the batch is full (:data:`BATCH_BYTES`)."""
        self._items.append((param, grad, grad._version))
        self._ids.add(id(param))
        self.bytes += grad.numel() * grad.element_size()
        return self.bytes >= BATCH_BYTES

    def step(self) -> BaseException | None:
        """Step the batch, one engine call per param group, each parameter clipped by
        itself first; free each group's gradients once it has stepped. The batch is
        empty afterwards. A step that raised is returned, not raised: that group (as
        far as the optimizer got) and the groups after it keep their gradients."""
        items = self._take()
        if not items:
            return None
        try:
            for plan in self._plans_of([param for param, _, _ in items]):
                if self.clipping.enabled:
                    for param in plan.params:
                        self.clipping.apply([param])
                self.engine.step_plan(plan)
                for param in plan.params:
                    param.grad = None
        except Exception as error:
            return closure_needed(error)
        return None

    def drop(self, *, keep_grads: bool) -> None:
        """Forget the batch unstepped. ``keep_grads=False`` (a batch left by a backward
        that raised before its end): a gradient still in place and unchanged is set to
        None, neither stepped nor carried into the next backward, as the plain loop's
        ``zero_grad()`` after a caught error leaves it; one the loop changed since is
        left as the loop made it."""
        items = self._take()
        if not keep_grads:
            for param, grad, version in items:
                if param.grad is grad and grad._version == version:
                    param.grad = None

    def added_to(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient is still the one it was batched with, changed
        since: at the first hook of the next backward, that backward added to it."""
        grad = param.grad
        return any(p is param and g is grad and g._version != v
                   for p, g, v in self._items)

    def _take(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        items, self._items = self._items, []
        self._ids = set()
        self.bytes = 0
        return items

    def _plans_of(self, params: list[torch.Tensor]) -> list[StepPlan]:
        """A plan per param group of ``params`` (owned ones only), made once per
        batch and layout."""
        key = tuple(map(id, params))
        version = self.engine.layout_version
        plans = self._plans.get(key)
        if plans is None or any(plan.version != version for plan in plans):
            if len(self._plans) >= _KEPT_PLANS:
                self._plans.clear()  # backwards in ever new orders
            whole = self.engine.plan(params)
            plans = [whole] if len(whole.groups) <= 1 else \
                [self.engine.plan(group) for _, group in whole.groups]
            self._plans[key] = plans
        return plans
