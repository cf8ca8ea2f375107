"""``learn_first_step`` on :class:`~overlapkit.PostLocalSGDOptimizer`, passed down.

overlapkit's refusals of a loop that uses the window between backward and ``step()``
say "call optimizer.learn_first_step(model) once before the loop". With post-local SGD
over an overlapped optimizer (``PostLocalSGDOptimizer(overlap_ddp(...), averager)``)
the optimizer the loop holds is the PostLocalSGDOptimizer, which had no such method:
the advice ended in ``AttributeError`` (f2b92e2). :class:`LearnsFirstStep` gives it
one that passes the call to the local optimizer, keeping what the PostLocalSGDOptimizer
decided (every step in the plain order for an averager whose ``before_step`` may use
the parameters before any step).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LearnsFirstStep"]


class LearnsFirstStep:
    """Mixin of :class:`~overlapkit.PostLocalSGDOptimizer`: :meth:`learn_first_step`."""

    wrapped: torch.optim.Optimizer
    _first_step_deferred: bool

    def learn_first_step(self, model: torch.nn.Module | None = None,
                         accumulate: str | None = None, *, plain_order: bool = False,
                         loop_clips: float | None = None) -> None:
        """The local optimizer's ``learn_first_step`` (an overlapped one: see
        :meth:`OverlappedOptimizerFacade.learn_first_step
        <overlapkit.overlap.facade.OverlappedOptimizerFacade.learn_first_step>`), with
        the same arguments; its first step is then taken at ``step()``, after the
        averager's ``before_step``. A local optimizer that already takes every step at
        ``step()`` in the plain order keeps doing so (``plain_order=True``). A plain
        local optimizer steps at ``step()`` anyway: nothing to learn, nothing done."""
        inner: Any = self.wrapped
        learn = getattr(inner, "learn_first_step", None)
        if not callable(learn):
            return
        plain_order = plain_order or bool(getattr(inner, "steps_in_plain_order", False))
        learn(model, accumulate, plain_order=plain_order, loop_clips=loop_clips)
        self._first_step_deferred = True
