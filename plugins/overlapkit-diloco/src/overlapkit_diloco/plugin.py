"""The overlapkit plugin: registers the ``diloco`` averager.

Found by overlapkit through this package's entry point::

    [project.entry-points.overlapkit]
    diloco = "overlapkit_diloco.plugin"
"""

from __future__ import annotations

from typing import Any

import overlapkit
from overlapkit_diloco.averager import DiLoCoAverager


def build_diloco(
    *,
    period: int,
    warmup_steps: int = 0,
    process_group: Any = None,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    fragments: int = 1,
    fragment_sync_delay: int = 0,
    fragment_update_alpha: float = 0.0,
) -> DiLoCoAverager:
    """A :class:`DiLoCoAverager`: ``post_local_sgd(..., averager="diloco", outer_lr=...)``;
    ``fragments=N``, ``fragment_sync_delay`` and ``fragment_update_alpha`` for
    Streaming DiLoCo."""
    return DiLoCoAverager(period, warmup_steps, process_group, outer_lr=outer_lr,
                          outer_momentum=outer_momentum, fragments=fragments,
                          fragment_sync_delay=fragment_sync_delay,
                          fragment_update_alpha=fragment_update_alpha)


@overlapkit.hookimpl
def overlapkit_register_averagers() -> overlapkit.AveragerRecord:
    return overlapkit.AveragerRecord(
        name="diloco", build=build_diloco,
        description="DiLoCo: every `period` steps an outer Nesterov SGD step on the "
        "averaged pseudo-gradient",
    )
