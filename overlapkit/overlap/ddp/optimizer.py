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

import torch

from overlapkit.overlap.core.engine import OverlapEngine
from overlapkit.overlap.ddp.bucket_stepper import BucketStepper
from overlapkit.overlap.ddp.hook_state import CommHookStateFacade
from overlapkit.overlap.resolved import ModelFacts

__all__ = ["TECHNIQUE", "DDPOverlapOptimizer"]

TECHNIQUE = "overlap_ddp"


class DDPOverlapOptimizer(CommHookStateFacade):
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
        self._hook_name = comm_hook

    def last_buckets(self) -> list[list[torch.Tensor]]:
        """The owned parameters stepped together in each bucket of the last
        synchronised backward, in bucket order (DDP rebuilds its buckets after the
        first iteration). Norm clipping applies per entry."""
        buckets = self._stepper.last_buckets
        return [list(buckets[i]) for i in sorted(buckets)]
