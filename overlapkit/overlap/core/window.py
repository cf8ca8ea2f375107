"""The window between backward and ``step()``: what a loop does in it, learned from its
first optimizer step, then honoured in the plain order.

A plain loop can read and change gradients after ``backward()`` and before ``step()``
(gradient noise, masking, per-parameter norms), or run several backwards before one
``step()`` (gradient accumulation written without ``no_sync()``). Stepping during backward
removes that window. In a loop known to call ``step()`` (an Accelerate loop set up by
:func:`overlapkit.integrations.accelerate.prepare`), the facade's
:meth:`~overlapkit.overlap.facade.OverlappedOptimizerFacade.learn_first_step` defers the
first optimizer step (``defer_steps()``'s mechanism: backwards reduce, keep ``.grad``,
step nothing), and :class:`FirstWindow` records what the loop did until ``step()``:

- the backwards that would have stepped (more than one: accumulation);
- each gradient's identity and version counter at the end of each backward (in-place
  changes bump a tensor's version; ``param.grad = ...`` replaces it): a gradient changed
  before ``step()`` shows the loop edits gradients;
- a ``clip_grad_norm_`` / ``clip_grad_value_`` the loop ran on the kept gradients (the
  plain loop's own clip, bumping their versions; not an edit, and the full step then
  does not clip again).

At ``step()`` the first step is taken as the plain loop takes it (a full step of the
kept gradients). A loop that used the window keeps every later step in that plain
order, with one warning naming what it did and how to keep the overlap: the run is
the plain run, bitwise. Any other loop steps during backward from its second step on.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch

__all__ = ["FirstWindow", "plain_order_warning", "state"]


def state(param: torch.Tensor) -> tuple[int, int]:
    """What tells that ``param``'s gradient changed: its identity and version counter."""
    grad = param.grad
    return (0, 0) if grad is None else (id(grad), grad._version)


@attrs.define
class FirstWindow:
    """What the loop did between backward and ``step()`` while steps are deferred to learn
    it (see the module docstring)."""

    #: backwards that would have stepped (not inside ``no_sync()`` / ``no_step()``)
    backwards: int = 0
    #: ``id(param)`` -> ``(id(grad), grad._version)`` at the end of the last backward
    marks: dict[int, tuple[int, int]] = attrs.field(factory=dict)
    #: the loop clipped the kept gradients itself (torch's clip, in place)
    clipped: bool = False
    #: the loop has been found to use the window: every step stays in the plain order
    plain_order: bool = False

    def mark(self, params: Iterable[torch.Tensor]) -> None:
        """Record the gradients of ``params`` as they are now (end of a backward, or
        right after the loop's own clip)."""
        for param in params:
            self.marks[id(param)] = state(param)

    def clipped_by_loop(self, param: torch.Tensor, before: tuple[int, int]) -> None:
        """The loop's clip rewrote ``param``'s gradient (in place), which was ``before``
        (:func:`state`) then: not an edit, unless it had been edited before the clip."""
        if self.marks.get(id(param)) == before:
            self.mark([param])

    def edited(self, named: dict[int, str], params: Iterable[torch.Tensor]) -> list[str]:
        """The names of ``params`` whose gradient changed since it was marked."""
        found = []
        for param in params:
            if id(param) in self.marks and self.marks[id(param)] != state(param):
                found.append(named.get(id(param), f"a parameter of shape {tuple(param.shape)}"))
        return found

    def reset(self) -> None:
        """A new optimizer step starts (after ``step()``)."""
        self.backwards, self.marks, self.clipped = 0, {}, False


def plain_order_warning(technique: str, used: str) -> str:
    """The one warning of a loop that uses the window: what it did, how to keep the
    overlap."""
    return (
        f"{technique} takes every step of this loop at optimizer.step(), in the plain "
        f"order, without overlap: {used} between backward and optimizer.step(), a window "
        "that stepping during backward removes. The run is the plain loop's, bitwise. To "
        "keep the overlap: accumulate gradients inside accelerator.accumulate(model) (or "
        "the model's no_sync()), and change gradients before they are reduced (a DDP "
        "comm hook, a gradient hook on the parameter) instead of between backward and "
        "step()."
    )
