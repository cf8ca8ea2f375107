"""What the overlapped optimizer's facade needs of whatever steps during backward.

:class:`~overlapkit.overlap.facade.OverlappedOptimizerFacade` reports the loop's
``step()``, ``zero_grad()`` and ``load_state_dict()`` calls to a step account (each
technique's stepper); this protocol is that contract, kept apart from the facade so
the facade holds only what a user calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from overlapkit.errors import OverlapkitError
from overlapkit.overlap.core.window import FirstWindow
from overlapkit.overlap.rules.global_step import GlobalStep

__all__ = ["BackwardSteps"]


class BackwardSteps(Protocol):
    """What steps during backward (a :class:`~overlapkit.overlap.core.step_accounting.StepAccount`):
    the facade reports ``step()``, ``zero_grad()`` and ``load_state_dict()`` calls to
    it; ``register(params)`` hooks parameters added later (``add_param_group``)."""

    #: any backward has stepped
    has_stepped: bool

    def step_called(self) -> bool: ...

    def zero_grad_called(self) -> None: ...

    def release_state(self, at_step: bool = False) -> None: ...

    def register(self, params: Iterable[torch.Tensor]) -> None: ...

    def synchronize(self) -> None: ...

    def window_refusal(self, call: str, *, loading: bool = False) -> str | None: ...

    #: what waits for the end of backward (global clipping, a GradScaler), or None
    global_step: GlobalStep | None

    #: what a step() with no stepping backward since the last applies (clipping, a
    #: GradScaler's unscale and inf check), or None for the optimizer's plain step()
    full_step: GlobalStep | None

    #: while true, backwards step nothing (:meth:`OverlappedOptimizerFacade.defer_steps`)
    deferring: bool

    def deferred(self) -> None: ...

    #: asked when a stepping backward starts: the error to refuse it with, or None
    backward_gate: Callable[[], OverlapkitError | None] | None

    #: what the loop does in the window while steps are deferred to learn it, or None
    first_window: FirstWindow | None

    #: the first step was learnt (``learn_first_step``) and the loop steps in backward
    learned: bool

    #: the loop has called step() right after a stepping backward
    calls_step: bool

    #: how to accumulate with this model, for messages
    accumulate: str

    #: a backward has stepped since the last step()
    stepped_since_step: bool

    #: the function that built it, for messages
    technique: str

    #: the gradients the last stepping backward left, to check at step(), or None
    stepped_marks: FirstWindow | None
    #: the real optimizer whose param-group settings a change before step() would miss
    settings_of: torch.optim.Optimizer | None

    #: the parameters whose gradients the last stepping backward freed, while no
    #: zero_grad() has come since, or None
    freed: list[torch.Tensor] | None
