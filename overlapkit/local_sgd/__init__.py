"""Post-local SGD: local optimizer steps with periodic (or hierarchical) model averaging.

- :mod:`~overlapkit.local_sgd.optimizer`: :func:`post_local_sgd`,
  :class:`PostLocalSGDOptimizer`;
- :mod:`~overlapkit.local_sgd.averagers`: the model averagers;
- :mod:`~overlapkit.local_sgd.averaging`: which tensors are averaged, and how;
- :mod:`~overlapkit.local_sgd.hierarchy`: hierarchical levels from the launch;
- :mod:`~overlapkit.local_sgd.failures`: an averager raising on one rank, the others
  told; an averager state that cannot be saved or loaded, refused naming it;
- :mod:`~overlapkit.local_sgd.watched_collectives`: an averager's own blocking
  collectives told of that failure too;
- :mod:`~overlapkit.local_sgd.first_step`: ``learn_first_step`` passed down;
- :mod:`~overlapkit.local_sgd.comm_hook`: the ``post_local_sgd`` DDP comm hook and its
  subgroup policy;
- :mod:`~overlapkit.local_sgd.plugin`: the built-in plugin ``overlapkit.local_sgd``, and
  :func:`create_averager`.
"""

from __future__ import annotations

from overlapkit.local_sgd.optimizer import PostLocalSGDOptimizer, create_averager, post_local_sgd
from overlapkit.overlap.core.eager_steps import run_eagerly_when_compiled

__all__ = ["PostLocalSGDOptimizer", "create_averager", "post_local_sgd"]

# called from a torch.compile'd step(), the averager's work runs eagerly and the local
# step compiles as a plain optimizer's (overlap/core/eager_steps.py)
run_eagerly_when_compiled(PostLocalSGDOptimizer, "_before_local_step")
run_eagerly_when_compiled(PostLocalSGDOptimizer, "_after_local_step")
