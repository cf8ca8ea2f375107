"""The overlapkit conformance check for the DiLoCo averager: with outer_lr=1 and no
outer momentum it is exact averaging (its documented limit), and its state round-trips
(2 gloo ranks)."""

from __future__ import annotations

from overlapkit.testing import check_averager


def test_diloco_reduces_to_exact_averaging_in_its_limit() -> None:
    check_averager("diloco", {"period": 2, "warmup_steps": 1, "outer_lr": 1.0,
                              "outer_momentum": 0.0})
