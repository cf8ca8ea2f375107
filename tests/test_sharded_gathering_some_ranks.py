"""``consolidate_state_dict()`` or ``overlapkit.checkpoint.save`` on rank 0 alone, the
other rank training on (a loop's ``if rank == 0: opt.consolidate_state_dict(0);
torch.save(opt.state_dict(), path)``): refused at once on rank 0, naming the collective
and what to do, nothing changed (0.4.0: rank 0 waited until the process group's
timeout, in a checkpoint's save until the default group's), at 2 gloo ranks."""

from __future__ import annotations

import pytest
import sharded_some_ranks_ranks as ranks_

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    path = str(tmp_path_factory.mktemp("some_ranks") / "checkpoint")
    return run_distributed(ranks_.some_ranks, 2, args=(path,), timeout=240)


@pytest.mark.parametrize("part", ["gather/step", "gather/backward", "checkpoint/backward"])
def test_saving_on_one_rank_while_another_trains_is_refused_at_once(
        results: list[dict], part: str) -> None:
    gathering = results[0][part]
    error = gathering["error"]
    assert error is not None and error["type"] == "ConfigurationError", error
    call = "consolidate_state_dict()" if part.startswith("gather") else \
        "overlapkit.checkpoint.save"
    assert f"{call} is a collective: every rank calls it" in error["message"]
    assert "not under `if rank == 0:`" in error["message"]
    assert gathering["seconds"] < ranks_.TIMEOUT / 2, gathering["seconds"]
    assert gathering["unchanged"]


@pytest.mark.parametrize("part", ["gather/step", "gather/backward", "checkpoint/backward"])
def test_the_rank_training_on_is_refused_naming_the_save_nothing_stepped(
        results: list[dict], part: str) -> None:
    training = results[1][part]
    error = training["error"]
    assert error is not None and error["type"] == "ConfigurationError", error
    call = "consolidate_state_dict()" if part.startswith("gather") else \
        "overlapkit.checkpoint.save"
    assert f"called {call} while this rank started" in error["message"]
    assert training["unchanged"]
    if part.endswith("step"):  # no reduction waits for the gathering rank
        assert training["seconds"] < ranks_.TIMEOUT / 2, training["seconds"]


def test_ranks_saving_each_their_own_way_are_refused_at_once_on_both(
        results: list[dict]) -> None:
    for rank, result in enumerate(results):
        part = result["checkpoint/gather"]
        error = part["error"]
        assert error is not None and error["type"] == "ConfigurationError", (rank, error)
        assert "Both are collectives" in error["message"], error
        assert part["seconds"] < ranks_.TIMEOUT / 2 and part["unchanged"], part
