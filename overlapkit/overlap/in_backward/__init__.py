"""The in-backward path: each parameter of a plain or FSDP2 module stepped from its
post-accumulate-grad hook, its gradient freed once stepped.

Its set-up (:mod:`~overlapkit.overlap.in_backward.setup`: the kind of model, the hooks
and the forward pre-hooks that guard them), the parameter stepper
(:mod:`~overlapkit.overlap.in_backward.param_stepper`; on CPU its steps are taken in
batches: :mod:`~overlapkit.overlap.in_backward.param_batch`) and the optimizer
``optimizer_in_backward`` returns on any model
(:mod:`~overlapkit.overlap.in_backward.optimizer`). A DDP model takes the DDP path
(:mod:`overlapkit.overlap.ddp`).
"""

from __future__ import annotations

from overlapkit.overlap.in_backward.optimizer import OptimizerInBackward

__all__ = ["OptimizerInBackward"]
