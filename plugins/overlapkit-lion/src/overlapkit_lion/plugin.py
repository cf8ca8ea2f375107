"""The overlapkit plugin: registers :class:`LionOverlapped` for :class:`Lion`.

Found by overlapkit through this package's entry point::

    [project.entry-points.overlapkit]
    lion = "overlapkit_lion.plugin"
"""

from __future__ import annotations

import overlapkit
from overlapkit_lion.optimizer import Lion
from overlapkit_lion.overlapped import LionOverlapped


@overlapkit.hookimpl
def overlapkit_register_optimizers() -> overlapkit.OptimizerRecord:
    return overlapkit.OptimizerRecord(
        optim_cls=Lion, overlapped_cls=LionOverlapped,
        description="Lion: a whole bucket per step with foreach kernels",
    )
