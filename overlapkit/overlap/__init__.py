"""The two techniques that step during backward, and the engine they share.

- :mod:`~overlapkit.overlap.ddp`: :func:`overlap_ddp`, DDP allreduce-then-step;
- :mod:`~overlapkit.overlap.in_backward`: :func:`optimizer_in_backward` (DDP, FSDP2,
  plain modules);
- :mod:`~overlapkit.overlap.engine`: the engine base class plugins subclass;
  :mod:`~overlapkit.overlap.generic` the engine for any ``torch.optim`` optimizer;
- :mod:`~overlapkit.overlap.facade`: the ``torch.optim.Optimizer`` users get back;
- :mod:`~overlapkit.overlap.bucket_stepper` and :mod:`~overlapkit.overlap.param_stepper`:
  what steps per bucket and per parameter during backward;
  :mod:`~overlapkit.overlap.bucket_layout`: what is kept per bucket between backwards;
  :mod:`~overlapkit.overlap.side_stream`: where, on an accelerator;
- :mod:`~overlapkit.overlap.direct_step`, :mod:`~overlapkit.overlap.functional_step`:
  the generic engine's cheaper calls of ``step()`` where they are the same computation;
- :mod:`~overlapkit.overlap.setup`, :mod:`~overlapkit.overlap.ddp_setup`,
  :mod:`~overlapkit.overlap.clipping`: the checks and options at set-up;
- :mod:`~overlapkit.overlap.late_clipping`: torch's ``clip_grad_norm_`` after a
  backward that already stepped, answered or refused;
- :mod:`~overlapkit.overlap.plugin`: the built-in plugin ``overlapkit.overlap``.
"""

from __future__ import annotations

from overlapkit.overlap.ddp import DDPOverlapOptimizer, overlap_ddp
from overlapkit.overlap.in_backward import OptimizerInBackward, optimizer_in_backward

__all__ = ["DDPOverlapOptimizer", "OptimizerInBackward", "optimizer_in_backward", "overlap_ddp"]
