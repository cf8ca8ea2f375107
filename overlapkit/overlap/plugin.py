"""Built-in plugin ``overlapkit.overlap``: the engine behind ``overlap_ddp`` and
``optimizer_in_backward`` for every ``torch.optim`` optimizer.

It registers :class:`~overlapkit.overlap.core.generic.GenericOverlapEngine` for
``torch.optim.Optimizer``, the root of the MRO walk, so it serves every optimizer class
that no plugin serves more specifically.
"""

from __future__ import annotations

import torch

from overlapkit.overlap.core.generic import GenericOverlapEngine
from overlapkit.plugin.hookspecs import hookimpl
from overlapkit.plugin.records import OptimizerRecord

__all__ = ["overlapkit_register_optimizers"]


@hookimpl
def overlapkit_register_optimizers() -> OptimizerRecord:
    return OptimizerRecord(
        optim_cls=torch.optim.Optimizer,
        overlapped_cls=GenericOverlapEngine,
        description="any torch.optim optimizer, stepped one bucket at a time",
    )
