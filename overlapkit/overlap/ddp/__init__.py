"""The DDP path: steps taken as each DDP gradient bucket's reduction completes.

Its set-up (:mod:`~overlapkit.overlap.ddp.setup`: resolve the DDP model and the comm
hook, check what only DDP asks, register the comm hook; a comm hook the user registers
later refused by name: :mod:`~overlapkit.overlap.ddp.comm_hook_guard`), the comm hook that decides
when each bucket is stepped (:mod:`~overlapkit.overlap.ddp.bucket_stepper`; on CPU in the
order :mod:`~overlapkit.overlap.ddp.inline_schedule` chooses, from what gloo's threads
spend while a rank waits: :mod:`~overlapkit.overlap.ddp.comm_threads`), how runs of reduced
buckets are stepped (:mod:`~overlapkit.overlap.ddp.bucket_steps`; their reduced gradients
copied into ``.grad`` while later reductions are in flight:
:mod:`~overlapkit.overlap.ddp.filled_grads`; a reduction that fails
is raised as one overlapkit error when backward ends:
:mod:`~overlapkit.overlap.ddp.failed_reductions`; a bucket DDP never reduced, its
gradients freed, likewise: :mod:`~overlapkit.overlap.ddp.unreduced`; a join dividing
by the ranks left, refused at the forward: :mod:`~overlapkit.overlap.ddp.join_divide`;
a comm hook that replaced its bucket's buffer, stepped from DDP's own:
:mod:`~overlapkit.overlap.ddp.replaced_buffers`),
the hooks on the parameters
beside it (:mod:`~overlapkit.overlap.ddp.param_hooks`; where plain DDP divides gradients
kept as bucket views: :mod:`~overlapkit.overlap.ddp.kept_gradients`) and the optimizer
``overlap_ddp`` returns (:mod:`~overlapkit.overlap.ddp.optimizer`; its comm hook's
state in its ``state_dict()``: :mod:`~overlapkit.overlap.ddp.hook_state`).
``optimizer_in_backward`` on a DDP model and sharded state
(:mod:`overlapkit.overlap.sharded`) take this path too.
"""

from __future__ import annotations

from overlapkit.overlap.ddp.optimizer import DDPOverlapOptimizer

__all__ = ["DDPOverlapOptimizer"]
