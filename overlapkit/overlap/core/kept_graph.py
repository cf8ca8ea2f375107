"""A second backward through a graph kept with ``retain_graph=True``, after a backward
that stepped: refused before autograd reaches the parameters.

A plain loop may run two backwards through one graph before ``step()`` (an auxiliary
loss, adversarial training: ``loss.backward(retain_graph=True)``, then another): the
parameters are unchanged until ``step()``. Stepping during backward changes them in
place during the first, so autograd refuses the second when it unpacks a saved
parameter, deep inside the graph, with its own ``RuntimeError`` ("modified by an
inplace operation"). A hook on the model's output nodes runs first: each output node
of a forward counts the backwards through it, and the second one after a stepping
backward (no ``step()`` between) raises
:func:`kept_graph_refusal` there, before any node of
the model runs — so no gradient, DDP bucket or step is touched, and every rank (running
the same loop) raises at the same point. Measured on torch 2.13: an exception raised in
a node's pre-hook leaves ``backward()`` as itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.core.own_hooks import OwnHook
from overlapkit.overlap.core.step_accounting import StepAccount

__all__ = ["kept_graph_refusal", "refusing_second_backwards", "second_backward_refusal"]


class _BackwardsThrough:
    """Pre-hook of one output node: counts the backwards through it."""

    def __init__(self, steps: StepAccount) -> None:
        self._steps = steps
        self._runs = 0

    def __call__(self, grad_outputs: Any) -> None:
        self._runs += 1
        steps = self._steps
        unreduced = getattr(steps, "unreduced", None)  # a DDP model's: names the reason
        if self._runs > 1 and unreduced is not None:
            unreduced.again_through_kept_graph = True
        if self._runs > 1 and steps.stepped_since_step and not steps.deferring:
            raise kept_graph_refusal(steps)


def refusing_second_backwards(steps: StepAccount) -> Callable[..., None]:
    """The forward hook for the model ``steps`` steps (``model.register_forward_hook``):
    it hooks each output node of a forward (while grad is enabled) so that a second
    backward through it after a stepping backward is refused (module docstring). Per
    forward, one pre-hook per output node. A no-op in a copy of the model
    (:class:`~overlapkit.overlap.core.own_hooks.OwnHook`)."""
    return OwnHook(_hook_output_nodes, steps)


def _hook_output_nodes(module: torch.nn.Module, args: Any, output: Any,
                       steps: StepAccount) -> None:
    if not torch.is_grad_enabled():
        return
    seen: set[int] = set()
    for each in tree_flatten(output)[0]:
        node = each.grad_fn if isinstance(each, torch.Tensor) else None
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            node.register_prehook(_BackwardsThrough(steps))


def second_backward_refusal(steps: Any, error: BaseException) -> ConfigurationError | None:
    """The error for autograd's ``error`` from a backward through a graph kept with
    ``retain_graph=True`` whose saved parameters the previous backward's step changed in
    place (a second backward before ``step()``: an auxiliary loss, adversarial
    training), or None when it is something else. Autograd raises before any of the
    technique's hooks see that backward (measured on torch 2.13: the parameters are
    unchanged by it), so the step-accounting refusal of a second backward never runs.
    (:func:`refusing_second_backwards` raises it first where the graph's output is the
    model's.)

    :param steps: the facade's :class:`~overlapkit.overlap.backward_steps.BackwardSteps`.
    """
    if not (isinstance(error, RuntimeError) and steps.stepped_since_step
            and "modified by an inplace operation" in str(error)):
        return None
    return kept_graph_refusal(steps)


def kept_graph_refusal(steps: Any) -> ConfigurationError:
    """The error of a second backward before ``step()`` through a graph kept with
    ``retain_graph=True``, after a backward that stepped the parameters it saved."""
    return ConfigurationError(
        f"backward() ran again before optimizer.step(), through a graph kept with "
        f"retain_graph=True, after the previous backward had stepped the parameters "
        f"that graph saved: {steps.technique} steps during backward, so every backward is "
        "one optimizer step, and autograd cannot run the second (its saved parameters "
        "were changed in place). Nothing was stepped in this backward; the parameters "
        "have taken the first one's step. Sum the losses into one backward "
        f"(loss + aux_loss), or run all but the last backward {steps.accumulate}; "
        "restart from the last checkpoint after fixing the loop."
    )
