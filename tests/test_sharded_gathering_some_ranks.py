"""``consolidate_state_dict()`` on rank 0 alone, the other rank training on (a loop's
``if rank == 0: opt.consolidate_state_dict(0); torch.save(opt.state_dict(), path)``):
refused at once on rank 0, naming the collective and what to do, nothing changed
(0.4.0: rank 0 waited until the process group's timeout), at 2 gloo ranks."""

from __future__ import annotations

import pytest
import sharded_some_ranks_ranks as ranks_

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(ranks_.some_ranks, 2, timeout=240)


@pytest.mark.parametrize("other", ["step", "backward"])
def test_gathering_on_one_rank_while_another_trains_is_refused_at_once(
        results: list[dict], other: str) -> None:
    gathering = results[0][other]
    error = gathering["error"]
    assert error is not None and error["type"] == "ConfigurationError", error
    assert "consolidate_state_dict() is a collective: every rank calls it" in \
        error["message"]
    assert "not under `if rank == 0:`" in error["message"]
    assert gathering["seconds"] < ranks_.TIMEOUT / 2, gathering["seconds"]
    assert gathering["unchanged"]


@pytest.mark.parametrize("other", ["step", "backward"])
def test_the_rank_training_on_is_refused_naming_the_gathering_nothing_stepped(
        results: list[dict], other: str) -> None:
    training = results[1][other]
    error = training["error"]
    assert error is not None and error["type"] == "ConfigurationError", error
    assert "called consolidate_state_dict() while this rank started" in error["message"]
    assert training["unchanged"]
    if other == "step":  # no reduction waits for the gathering rank
        assert training["seconds"] < ranks_.TIMEOUT / 2, training["seconds"]
