"""The optimizer :func:`overlapkit.overlap_ddp` returns without sharded state:
:class:`DDPOverlapOptimizer`.

One DDP comm hook runs the chosen comm hook on each gradient bucket and, as soon as
that bucket's future completes, steps the optimizer on exactly that bucket's
parameters, while backward is still running for the other buckets. The comm hook itself
lives in :mod:`overlapkit.overlap.ddp.bucket_stepper`, its set-up in
:mod:`overlapkit.overlap.ddp.setup`, the returned optimizer's behaviour in
:mod:`overlapkit.overlap.facade`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from overlapkit.overlap.core.engine import OverlapEngine
from overlapkit.overlap.ddp.bucket_stepper import BucketStepper
from overlapkit.overlap.ddp.hook_state import KEY, hook_state_loader, saved_hook_state
from overlapkit.overlap.facade import OverlappedOptimizerFacade
from overlapkit.overlap.resolved import ModelFacts

__all__ = ["TECHNIQUE", "DDPOverlapOptimizer"]

TECHNIQUE = "overlap_ddp"


class DDPOverlapOptimizer(OverlappedOptimizerFacade):
    """The optimizer :func:`overlap_ddp` returns: a ``torch.optim.Optimizer`` whose
    steps happen during backward, one DDP bucket at a time.

    ``param_groups``, ``state``, ``defaults``, ``state_dict()`` and
    ``load_state_dict()`` are those of the real optimizer inside (see
    :attr:`optimizer`), so LR schedulers drive it and checkpoints load into a plain
    optimizer of the same class and back; ``state_dict()`` adds the comm hook's state
    under ``"comm_hook"`` where it keeps one (PowerSGD's, see
    :mod:`overlapkit.overlap.ddp.hook_state`), which a plain optimizer ignores.
    :meth:`step` is a no-op after a backward that already stepped.
    """

    def __init__(
        self,
        engine: OverlapEngine,
        stepper: BucketStepper,
        model: ModelFacts,
        comm_hook: str = "allreduce",
    ) -> None:
        super().__init__(engine, stepper, TECHNIQUE, model.check_params_now)
        self._stepper = stepper
        self._model = model.model
        self._hook_name = comm_hook  # the name it was chosen by, for messages
        self._hook_warned = [False, False]  # state_dict(), checkpoint.save()

    @property
    def comm_hook_state(self) -> Any:
        """The state of the comm hook this optimizer's model reduces with (what
        ``build_comm_hook(name)`` returns first: a ``PowerSGDState``, a process group)."""
        return self._stepper.inner_state

    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        saved = saved_hook_state(self._stepper.inner_state, self._hook_name,
                                 self._hook_warned)
        if saved is not None:
            state_dict[KEY] = saved
        return state_dict

    def left_out_of_checkpoints(self) -> str | None:
        """What ``overlapkit.checkpoint.save`` warns of, once: the comm hook's state,
        each rank's own, which DCP's replicated optimizer state cannot hold."""
        if self._hook_warned[1] or saved_hook_state(
                self._stepper.inner_state, self._hook_name, [True]) is None:
            return None
        self._hook_warned[1] = True
        return (f"overlapkit.checkpoint.save() does not hold the state of the comm hook "
                f"{self._hook_name!r}, each rank's own (PowerSGD's error feedback): "
                "a run resumed from the checkpoint alone starts that hook afresh. Save "
                "optimizer.state_dict() on every rank beside it (torch.save), and load it "
                "after checkpoint.load() with optimizer.load_state_dict().")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The real optimizer's ``load_state_dict``, and the comm hook's state where
        ``state_dict`` holds one (checked first: a refusal loads nothing)."""
        saved = state_dict.get(KEY) if isinstance(state_dict, Mapping) else None
        load_hook = hook_state_loader(self._stepper.inner_state,
                                      self._hook_name, saved)
        super().load_state_dict(state_dict)
        load_hook()

    def last_buckets(self) -> list[list[torch.Tensor]]:
        """The owned parameters stepped together in each bucket of the last
        synchronised backward, in bucket order (DDP rebuilds its buckets after the
        first iteration). Norm clipping applies per entry."""
        buckets = self._stepper.last_buckets
        return [list(buckets[i]) for i in sorted(buckets)]
