"""The two techniques that step during backward, assembled from the sub-packages below.

One sub-package per concept (0.4), each importing only the ones listed before it:

- :mod:`~overlapkit.overlap.core`: the engine core — the engine plugins subclass, the
  layouts kept per bucket, the backward scope, the loop's step accounting and its
  window, side streams, the cheaper direct and functional steps;
- :mod:`~overlapkit.overlap.rules`: the step rules — clipping, late clipping, loss
  scaling, the global step that waits for the end of backward;
- :mod:`~overlapkit.overlap.ddp`: the DDP path (its set-up, the bucket stepper, the
  parameter hooks beside it, its optimizer);
- :mod:`~overlapkit.overlap.in_backward`: the in-backward path on plain and FSDP2
  modules (its set-up, the parameter stepper, its optimizer);
- :mod:`~overlapkit.overlap.sharded`: sharded optimizer state on the DDP path.

The modules at this level assemble a technique from them: the set-up pass
(:mod:`~overlapkit.overlap.resolved`: resolve, check, build, with
:mod:`~overlapkit.overlap.setup` and :mod:`~overlapkit.overlap.adopt`), the facade
users get back (:mod:`~overlapkit.overlap.facade`), the guards against a plain
optimizer (:mod:`~overlapkit.overlap.plain_step_guard`) or a ``GradScaler``
(:mod:`~overlapkit.overlap.scaler_guard`) driving what the technique steps, the two
public calls
(:mod:`~overlapkit.overlap.techniques`) and the built-in plugin ``overlapkit.overlap``
(:mod:`~overlapkit.overlap.plugin`).
"""

from __future__ import annotations

from overlapkit.overlap.core.eager_steps import run_eagerly_when_compiled
from overlapkit.overlap.ddp.optimizer import DDPOverlapOptimizer
from overlapkit.overlap.facade import OverlappedOptimizerFacade
from overlapkit.overlap.in_backward.optimizer import OptimizerInBackward
from overlapkit.overlap.techniques import optimizer_in_backward, overlap_ddp

__all__ = ["DDPOverlapOptimizer", "OptimizerInBackward", "optimizer_in_backward", "overlap_ddp"]

# called from a torch.compile'd function, step() runs eagerly (core/eager_steps.py)
run_eagerly_when_compiled(OverlappedOptimizerFacade, "step")
