"""A ``step()`` after backwards that stepped nothing — only ``no_sync()`` /
``no_step()`` backwards — is an ordinary full step, and it applies everything the steps
in backward apply: value and norm clipping, and a GradScaler's unscale, inf check and
skip, in the same order, bitwise the plain loop. 0.2 stepped it unclipped (0.0072 off
after 4 steps) and on the *scaled* gradients, after which ``scaler.update()`` raised
torch's raw ``AssertionError`` — after the parameters had changed. The inf check handed
to the scaler belongs to that step, never to an earlier backward (here the previous
synchronised backward overflowed)."""

from __future__ import annotations

from typing import Any

import pytest
from full_step_ranks import SETUPS, run

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=300)


@pytest.mark.parametrize("setup", SETUPS)
def test_a_step_after_only_accumulating_backwards_is_bitwise_the_plain_loop(
        results: list[dict[str, Any]], setup: str) -> None:
    for rank_results in results:
        result = rank_results[setup]
        assert result["values"], result["values"]
        plain_scales, our_scales = result["scales"]
        assert plain_scales == our_scales
