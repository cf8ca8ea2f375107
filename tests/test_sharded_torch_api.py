"""A sharded optimizer (``overlap_ddp(..., shard_optimizer_state=True)``) driven through
torch's own APIs and called by some ranks only, on 2 and 3 gloo ranks: torch's
``set_optimizer_state_dict`` (keyed by parameter names) loads each rank's share and
training goes on bitwise the plain run (it loaded no state before 0.4),
``get_optimizer_state_dict`` is refused rather than returning one rank's share,
``load_state_dict`` between a stepping backward and ``step()`` is refused loading
nothing (it was taken, and ``step()`` then refused after the parameters had stepped),
``consolidate_state_dict`` on only some ranks names the missing rank at the group's
timeout (it was gloo's bare ``RuntimeError``), as does ``add_param_group`` on some
ranks only (gloo's bare ``RuntimeError`` before), and a rank
owning nothing trains, gathers and loads bitwise, through torch's API too (torch's
initialising step on that rank alone waited for the others' exchange until the group's
timeout), and refuses a load in the first window before anything loads (it loaded,
then refused ``step()``)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import sharded_torch_api_ranks as ranks_
from helpers import failures

from overlapkit.distributed import run_distributed

WORLD_SIZES = [2, 3]


def _run(fn: Any, world_size: int) -> list[Any]:
    return run_distributed(fn, world_size, timeout=300)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_torch_s_optimizer_state_dict_api_and_a_load_in_the_window(world_size: int) -> None:
    results = _run(ranks_.torch_state_dict_api, world_size)
    for rank, result in enumerate(results):
        assert result["get"]["type"] == "ConfigurationError", (rank, result["get"])
        assert "consolidate_state_dict" in result["get"]["message"]
        held, owned = result["entries"]
        assert held == owned, (rank, result["entries"])  # each rank's share, loaded
        error = result["loaded in window"]
        assert error is not None and error["type"] == "ConfigurationError", (rank, error)
        assert "Nothing was loaded" in error["message"], error
    assert not failures(results, "window: nothing changed")
    assert not failures(results, "values")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_consolidate_or_add_param_group_on_some_ranks_or_to_differing_is_named(
        world_size: int) -> None:
    results = _run(ranks_.consolidated_on_some_ranks, world_size)
    error = results[0]["added"]  # add_param_group on rank 0 only
    assert error is not None and error["type"] == "ExchangeFailedError", error
    assert "add_param_group" in error["message"], error
    assert re.search(r"ranks? [12]\b", error["message"]), error  # a silent one named
    assert results[0]["added seconds"] < 10, results[0]  # the group's 6 s + the roll call
    missing = world_size - 1
    for rank, result in enumerate(results[:missing]):
        error = result["error"]
        assert error is not None and error["type"] == "ExchangeFailedError", (rank, error)
        assert f"rank {missing}" in error["message"], error
        assert "consolidate_state_dict" in error["message"], error
        assert result["seconds"] < 9, result  # the group's 5 s + the roll call


def test_a_rank_owning_nothing_trains_gathers_and_loads_bitwise_also_through_torch_s_api(
        ) -> None:
    results = _run(ranks_.more_ranks_than_parameters, 3)
    assert sorted(r["owned"] for r in results) == [0, 1, 1], results
    assert not failures(results, "state")
    for rank, result in enumerate(results):
        error = result["first window"]
        assert error is not None and error["type"] == "ConfigurationError", (rank, error)
        assert "Nothing was loaded" in error["message"], error
        assert result["first window: nothing changed"], rank
        if rank != 2:
            assert result["torch get"]["type"] == "ConfigurationError", result["torch get"]
    assert not failures(results, "torch gathered")  # on the rank owning nothing
    assert not failures(results, "values")  # set_optimizer_state_dict on every rank


def test_an_optimizer_built_with_state_loads_through_torch_s_api_where_a_rank_owns_nothing(
        ) -> None:
    results = _run(ranks_.born_with_state, 3)
    assert sorted(r["owned"] for r in results) == [0, 1, 1], results
    for rank, result in enumerate(results):
        # was: ExchangeFailedError on the rank owning nothing after the 5 s timeout
        assert result["loaded"] is None, (rank, result["loaded"], result["seconds"])
    assert not failures(results, "gathered")
    assert not failures(results, "values")


@pytest.mark.parametrize("options", sorted(ranks_.FULL_OPTIONS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_torch_s_set_optimizer_state_dict_of_a_whole_dict_loads_each_rank_s_share(
        world_size: int, options: str) -> None:
    results = run_distributed(ranks_.full_state_dict_loads, world_size, args=(options,),
                              timeout=300)
    for rank, result in enumerate(results):
        for case, got in result.items():
            assert got["error"] is None, (rank, case, got["error"])
            assert got["state"], (rank, case)  # each rank's share: the plain optimizer's
            held, owned = got["held"]
            assert held == owned, (rank, case, got["held"])
            assert got["values"], (rank, case, got["values"])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_torch_s_whole_dict_offloaded_to_rank_0_needs_a_gathering_there_and_is_plain_s(
        world_size: int) -> None:
    results = _run(ranks_.offloaded_whole_dict, world_size)
    for rank, result in enumerate(results):
        for case in ("without a gathering", "gathered elsewhere"):
            # the same on every rank (was: refused on every rank but the gathering one)
            error = result[case]
            assert error is not None and error["type"] == "ConfigurationError", (
                rank, case, error)
            assert "consolidate_state_dict(to=0)" in error["message"], error
    assert not failures(results, "same")  # rank 0: the plain dict; elsewhere {}
    assert not failures(results, "groups")
    assert not failures(results, "values")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_another_model_s_state_dict_is_refused_on_every_rank_before_it_loads(
        world_size: int) -> None:
    results = _run(ranks_.another_model_s_dict, world_size)
    for rank, result in enumerate(results):
        loaded, through_torch, trained = result["errors"]
        for error in (loaded, through_torch):  # was: loaded, then only some ranks raised
            assert error is not None and error["type"] == "ConfigurationError", (rank, error)
            assert "Nothing was loaded" in error["message"], error
        assert trained is None, (rank, trained)
        assert result["unchanged"], rank
    assert not failures(results, "values")
