"""Whether the optimizer's own ``zero_grad`` keeps zero gradients where the loop's
``zero_grad()`` asks for None.

``optimizer_in_backward`` frees each gradient once stepped, so ``zero_grad(set_to_none=
False)`` after a stepping backward is refused and, in a loop that learnt its first
step, honoured by the plain order (:func:`~overlapkit.overlap.core.first_step.
zeros_refusal`, ``zeros_warning``). An optimizer class overriding ``zero_grad`` (or a
``zero_grad`` set on the instance) that zeroes whatever it is asked
(``super().zero_grad(set_to_none=False)``, a default of ``set_to_none=False``) went
past both: the loop's ``zero_grad()`` asked for None, the gradients stayed freed where
the plain loop holds zeros, and a parameter a backward did not reach was not stepped
where the plain ``step()`` steps it on its zero gradient (measured before this module:
0.0117 off the plain AdamW loop after 4 steps of a model whose last layer is used every
other step, 0.0068 learnt, silently).

:class:`GradZeroing` finds out at the first ``zero_grad()`` of such an optimizer, in
that call: a parameter without a gradient is given a zero one for it, and the call
shows whether it is set to None. From then on that ``zero_grad()`` counts as
``zero_grad(set_to_none=False)``. torch's own ``zero_grad`` is known without asking;
nothing is asked of ``overlap_ddp``, which keeps the gradients as the plain loop does.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["GradZeroing"]

_TORCH_ZERO_GRAD = inspect.unwrap(torch.optim.Optimizer.zero_grad)


def _own_zero_grad(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.zero_grad`` is torch's (no override in its class, none set on
    the instance)."""
    if hasattr(optimizer, "__dict__") and "zero_grad" in vars(optimizer):
        return False
    return inspect.unwrap(type(optimizer).zero_grad) is _TORCH_ZERO_GRAD


class GradZeroing:
    """Whether one optimizer's ``zero_grad(set_to_none=True)`` keeps zero gradients (see
    the module docstring).

    :param optimizer: the real optimizer.
    :param frees: the technique frees the gradients it steps (``optimizer_in_backward``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, frees: bool) -> None:
        #: True: it zeroes; False: it sets None (or nothing frees them); None: not known
        self.zeroes: bool | None = None if frees and not _own_zero_grad(optimizer) else False
        self._optimizer = optimizer
        cls = type(optimizer).__qualname__
        patched = vars(optimizer).get("zero_grad") if hasattr(optimizer, "__dict__") else None
        name = getattr(patched, "__qualname__", None) or type(patched).__qualname__
        #: what zeroes, in words, for the messages
        keeps = "keeps zero gradients where zero_grad() asks for None"
        self.what = (
            f"a zero_grad() set on this {cls} ({name}: it {keeps})"
            if patched is not None
            else f"{getattr(type(optimizer).zero_grad, '__qualname__', cls)}() (overriding "
            f"Optimizer.zero_grad(), it {keeps})"
        )

    def ask(self, zero_grad: Any) -> bool:
        """Call ``zero_grad`` (the real ``zero_grad(set_to_none=True)``, under the
        engine's lock) once, seeing whether it leaves zero gradients: a parameter without
        a gradient is lent a zero one for the call and left without one after it."""
        params = [p for group in self._optimizer.param_groups for p in group["params"]]
        lent = next((p for p in params if p.grad is None), None)
        seen = lent if lent is not None else next(iter(params), None)
        if lent is not None:
            lent.grad = torch.zeros_like(lent)
        try:
            zero_grad()
        finally:
            self.zeroes = seen is not None and seen.grad is not None
            if lent is not None:
                lent.grad = None
        return self.zeroes
