"""The warnings of the loop's reads noticed by
:class:`~overlapkit.overlap.core.watched_params.ParameterReads`: their words, and the
loop's line they point at.

A read of the parameters' values between a stepping backward and ``step()`` (one step
ahead of the plain loop's), a read of ``.grad`` that ``optimizer_in_backward`` freed
there (None: an edit skipped, a log empty), and such a read after ``step()``, before
``zero_grad()``, where the plain loop still holds the gradients (an LR scheduler or a
log reading them there: 0.4.0 development, a ``LambdaLR`` of the gradients' norm 0.023
off the plain SGD loop after 4 steps, silently).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from overlapkit.overlap.core.watched_reads import loop_stacklevel

__all__ = ["freed_gradient_read_warning", "loop_frame", "parameter_read_warning",
           "read_after_step_warning", "warn_at"]


def parameter_read_warning(technique: str) -> str:
    return (
        f"{technique} took this step during backward, so the parameters read between "
        "backward() and optimizer.step() hold this step's update already (the plain "
        "loop's hold the last step's: an EMA updated there, a copy or a logged norm are "
        "one step ahead of the plain loop's). Read them after optimizer.step() or before "
        "backward(), or call optimizer.learn_first_step(model) once before the loop (a "
        "loop reading them at its first step then takes every step at optimizer.step(), "
        "bitwise the plain loop). A change there is refused at optimizer.step(). Shown "
        "once.")


def freed_gradient_read_warning(technique: str, reads: int) -> str:
    return (
        f"the loop read .grad of parameters {technique} had stepped and freed during "
        f"backward ({reads} reads between backward() and optimizer.step()): they were "
        "None, where the plain loop's hold this backward's gradients. A change made to "
        "them there (noise, masking, a scale, a clip by hand: `if p.grad is not None`) "
        "was skipped and is not in the step, which was taken with the gradients as "
        "backward left them; a log of them is empty. Change gradients before they are "
        "stepped (a hook registered with register_post_accumulate_grad_hook on the "
        "parameter, a DDP comm hook, clip_grad_norm= of the optimizer), or call "
        "optimizer.learn_first_step(model) once before the loop (a loop using the "
        "gradients there at its first step then takes every step at optimizer.step(), "
        "in the plain order, bitwise the plain loop). Shown once.")


def loop_frame() -> tuple[str, int, dict[str, Any]]:
    """Where the loop reads (past overlapkit's and torch's frames:
    :func:`loop_stacklevel`): its file, line and globals."""
    frame = sys._getframe(loop_stacklevel() - 1)
    return frame.f_code.co_filename, frame.f_lineno, frame.f_globals


def read_after_step_warning(technique: str, reads: int) -> str:
    return (
        f"the loop read .grad of parameters {technique} had stepped and freed during "
        f"backward ({reads} reads after optimizer.step(), before zero_grad() or the next "
        "backward): they were None, where the plain loop's still hold this backward's "
        "gradients until zero_grad() (a gradient norm logged there is empty; an LR "
        "scheduler, or any step rule reading them, does not see them and differs from "
        "the plain loop's). Read the gradients as they are complete, in a hook "
        "registered with register_post_accumulate_grad_hook on the parameter (it runs "
        f"before {technique} frees them), or read the norm with clip_grad_norm= of the "
        "optimizer and torch.nn.utils.clip_grad_norm_ between backward() and step(); "
        "or use the plain optimizer for such a loop. Shown once.")


def warn_at(frame: tuple[str, int, dict[str, Any]], message: str,
             category: type[Warning]) -> None:
    """Warn ``message`` at the loop's line ``frame`` (:func:`loop_frame`) read."""
    filename, line, globs = frame
    warnings.warn_explicit(message, category, filename, line, module=globs.get("__name__"),
                           registry=globs.setdefault("__warningregistry__", {}))
