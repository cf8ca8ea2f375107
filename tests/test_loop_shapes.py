"""The loops people write around an optimizer that steps in backward all train exactly
as the plain loop (backward, ``step()``, ``zero_grad()`` each iteration): backward only
(PyTorch's fusing tutorial and its own overlap tests), backward then
``lr_scheduler.step()`` (torchtune), backward + ``step()`` + ``zero_grad()`` (torchtitan)
— for ``overlap_ddp`` and ``optimizer_in_backward``, on DDP (``gradient_as_bucket_view``
and ``static_graph`` on and off), FSDP2 and a plain module, with global clipping and with
``grad_scaler=``. 0.2 refused the first two shapes at the second iteration.
"""

from __future__ import annotations

from typing import Any

import pytest
from loop_shapes_ranks import cases, run

from overlapkit.distributed import run_distributed

CASES = [" | ".join(case) for case in cases()]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_the_loop_trains_bitwise_as_the_plain_loop(results: list[dict[str, Any]],
                                                    case: str) -> None:
    for rank, rank_results in enumerate(results):
        result = rank_results[case]
        assert result["values"], (rank, result["values"])
        assert result["state"], (rank, result["state"])
        assert result["trained"], rank
