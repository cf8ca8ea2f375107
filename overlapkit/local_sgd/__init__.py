"""Post-local SGD: local optimizer steps with periodic (or hierarchical) model averaging.

- :mod:`~overlapkit.local_sgd.optimizer`: :func:`post_local_sgd`,
  :class:`PostLocalSGDOptimizer`, :func:`create_averager`;
- :mod:`~overlapkit.local_sgd.averagers`: the model averagers;
- :mod:`~overlapkit.local_sgd.comm_hook`: the ``post_local_sgd`` DDP comm hook and its
  subgroup policy;
- :mod:`~overlapkit.local_sgd.plugin`: the built-in plugin ``overlapkit.local_sgd``.
"""

from __future__ import annotations

from overlapkit.local_sgd.optimizer import PostLocalSGDOptimizer, create_averager, post_local_sgd

__all__ = ["PostLocalSGDOptimizer", "create_averager", "post_local_sgd"]
