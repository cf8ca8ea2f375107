"""The overlapkit conformance check for the Lion plugin: its flat bucket steps under
overlap_ddp equal Lion's own step() bitwise (2 gloo ranks, LR scheduler, state_dict
round trip)."""

from __future__ import annotations

import pytest

from overlapkit.testing import check_overlapped_optimizer
from overlapkit_lion import Lion


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lion_conforms(weight_decay: float) -> None:
    check_overlapped_optimizer(Lion, {"lr": 1e-3, "weight_decay": weight_decay})
