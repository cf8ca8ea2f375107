"""One optimizer step per backward: the check that a loop ends each optimizer iteration
(``step()`` or ``zero_grad()``) before the next stepping backward.

Plain training steps once per ``optimizer.step()``, however many backwards ran before it
(gradients accumulate). An overlapped optimizer steps *during* backward, so a loop that
runs two backwards before one ``step()`` — gradient accumulation without ``no_sync()``,
two losses backpropagated separately — would take two steps where the plain loop takes
one, silently (measured on 0.1: Adam 0.033 off plain DDP after 4 backwards and 2
``step()`` calls). The steppers therefore refuse a backward that starts while the
previous stepping backward has not been followed by ``step()`` or ``zero_grad()`` (after
``zero_grad()`` no gradient is left to accumulate into): nothing is stepped in it, every
bucket is still reduced (the ranks stay in step), and the error below is raised when it
ends, on every rank. Backwards inside ``no_sync()`` / ``no_step()`` step nothing and
are not counted.
"""

from __future__ import annotations

from overlapkit.errors import ConfigurationError

__all__ = ["StepAccount", "backward_without_step_error"]


def backward_without_step_error(technique: str, accumulate: str) -> ConfigurationError:
    """The error of a backward that follows a stepping backward with no ``step()``.

    :param technique: ``"overlap_ddp"`` or ``"optimizer_in_backward"``.
    :param accumulate: how to accumulate with this model, e.g.
        ``"with ddp_model.no_sync():"``.
    """
    return ConfigurationError(
        "backward() ran again before optimizer.step() or zero_grad() was called for the "
        f"previous backward, which already stepped the parameters: {technique} steps during "
        "backward, so every backward is one optimizer step, and a second one would be "
        "a step the plain loop never takes. Nothing was stepped in this backward. To "
        "accumulate gradients "
        f"over several backwards, run all but the last {accumulate}; otherwise call "
        "optimizer.step() (a no-op) or zero_grad() after every backward."
    )


class StepAccount:
    """What a stepper counts of the backwards that stepped, for the optimizer it steps
    (the facade reads and clears both flags). The bucket and parameter steppers
    derive from it."""

    def __init__(self) -> None:
        #: set when a backward has stepped; the optimizer's ``step()`` clears it (and
        #: is then a no-op)
        self.stepped_since_step = False
        #: set likewise; cleared by ``step()`` and ``zero_grad()``: a stepping backward
        #: while it is set is refused
        self.awaiting_step = False

    def backward_starts(self, technique: str, accumulate: str) -> ConfigurationError | None:
        """Count a stepping backward that starts now: the error to hold until it ends
        (nothing steps in it) when the previous one was followed by neither ``step()``
        nor ``zero_grad()``, else None."""
        error = backward_without_step_error(technique, accumulate) if self.awaiting_step \
            else None
        self.stepped_since_step = self.awaiting_step = True
        return error
