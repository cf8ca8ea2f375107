"""The optimizer :func:`overlapkit.optimizer_in_backward` returns:
:class:`OptimizerInBackward`.

The optimizer steps each part of the model during backward, as soon as that part's
gradient is final, and frees the gradient, so the gradients of the whole model never
exist at once. One real optimizer instance takes every step (through the
:class:`~overlapkit.OverlapEngine` engine registered for its class), so the
returned object is a ``torch.optim.Optimizer``: LR schedulers, ``state_dict()`` and
checkpoints work as with the plain optimizer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.nn.parallel import DistributedDataParallel

from overlapkit.overlap.core.engine import OverlapEngine
from overlapkit.overlap.ddp.hook_state import CommHookStateFacade
from overlapkit.overlap.facade import BackwardSteps
from overlapkit.overlap.in_backward.param_stepper import ParamStepper
from overlapkit.overlap.resolved import ModelFacts

__all__ = ["TECHNIQUE", "OptimizerInBackward"]

TECHNIQUE = "optimizer_in_backward"


class OptimizerInBackward(CommHookStateFacade):
    """The optimizer :func:`optimizer_in_backward` returns: a ``torch.optim.Optimizer``
    whose steps happen during backward, after which the gradients are None.

    ``param_groups``, ``state``, ``defaults``, ``state_dict()`` and
    ``load_state_dict()`` are those of the real optimizer inside (see
    :attr:`optimizer`; on a DDP model ``state_dict()`` adds the comm hook's state,
    see :mod:`overlapkit.overlap.ddp.hook_state`); :meth:`step` is a no-op after a
    backward that stepped.
    """

    def __init__(
        self,
        engine: OverlapEngine,
        steps: BackwardSteps,
        model: ModelFacts,
    ) -> None:
        super().__init__(engine, steps, TECHNIQUE, model.check_params_now)
        self._model = model.model
        #: ``"ddp"``, ``"fsdp2"`` or ``"module"``: how the steps are hooked in
        self.kind = model.kind

    @contextmanager
    def no_step(self) -> Iterator[None]:
        """Backwards inside accumulate gradients and step nothing; the next backward
        outside steps the accumulated gradients (then frees them), as the plain
        optimizer's ``step()`` after accumulation would. For a DDP model this is
        ``ddp_model.no_sync()``."""
        if isinstance(self._steps, ParamStepper):
            stepper = self._steps
            stepper.paused = True
            try:
                yield
            finally:
                stepper.paused = False
        else:
            assert isinstance(self._model, DistributedDataParallel)
            with self._model.no_sync():
                yield
