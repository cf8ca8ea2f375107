"""overlapkit-lion: the Lion optimizer, and an overlapkit plugin for it.

    from overlapkit_lion import Lion
    optimizer = overlapkit.overlap_ddp(ddp_model, Lion, lr=1e-4)
"""

from overlapkit_lion.optimizer import Lion, lion_update
from overlapkit_lion.overlapped import LionOverlapped

__all__ = ["Lion", "LionOverlapped", "lion_update"]
