"""A full ``step()`` of a sharded optimizer with gradients that differ between ranks:
set by hand from ``torch.autograd.grad`` (which DDP does not reduce), accumulated under
``no_sync()`` only, or given noise from a per-rank seed between backward and ``step()``
in a learnt loop (the plain order). Plain DDP's replicas drift apart; before the
thirteenth round the sharded ones each stepped the parameters they own with their own
gradients, every replica a mix (AdamW, 0.0675 off plain rank 0 after 4 steps of
``autograd.grad``), silently. Now refused on every rank, nothing stepped
(:mod:`overlapkit.overlap.sharded.grad_agreement`); gradients the loop reduced itself
step bitwise as the plain loop's (2 gloo ranks, ``tests/sharded_rank_gradients_ranks.py``)."""

from __future__ import annotations

import pytest
from helpers import ranks_fixture
from sharded_rank_gradients_ranks import CASES, run

ranks = ranks_fixture(run, timeout=400)


@pytest.mark.parametrize("case", CASES[:3])
def test_gradients_differing_between_ranks_are_refused(ranks: list, case: str) -> None:
    for found in ranks:
        error = found[case]["error"]
        assert error is not None and error["type"] == "ConfigurationError", found[case]
        assert "different gradients" in error["message"], error["message"]
        assert error["unchanged"], error


def test_gradients_the_loop_reduced_step_as_the_plain_loop(ranks: list) -> None:
    for found in ranks:
        assert found[CASES[3]] == {"error": None, "equal": True}, found[CASES[3]]
