"""The whole state of a sharded optimizer gathered on one rank, and the exchange's
process group, at 3 gloo ranks (one run): the state changed after
``consolidate_state_dict()`` is refused at ``state_dict()``, ranks naming different
``to`` are refused at once on every rank, torch's ``get_optimizer_state_dict`` after a
state dict without state is loaded initialises the state as the plain optimizer's, load
pre-hooks see the whole dict, two sharded optimizers on overlapping subgroups are set up
and train bitwise, param groups reordered on one rank only are named at the gathering,
and the optimizer is refused once its process group is destroyed."""

from __future__ import annotations

import pytest
import sharded_gathering_ranks as ranks_
from helpers import failures

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(ranks_.gathering, 3, timeout=300)


def test_a_state_changed_after_the_gathering_is_refused_then_gathered_again(
        results: list[dict]) -> None:
    error = results[0]["changed"]
    assert error is not None and error["type"] == "ConfigurationError", error
    assert "consolidate_state_dict() on every rank again" in error["message"]
    assert "['exp_avg']" in error["message"]
    assert not failures(results, "gathered again")


def test_ranks_naming_different_destinations_are_refused_at_once_on_every_rank(
        results: list[dict]) -> None:
    for rank, result in enumerate(results):
        error = result["different"]
        assert error is not None and error["type"] == "ConfigurationError", (rank, error)
        assert "[0, 1, 2]" in error["message"], error
        assert result["seconds"] < 30, result["seconds"]  # not the group's timeout
    assert results[1]["then"] == 9


def test_torch_s_get_after_loading_a_dict_without_state_initialises_it_as_plain(
        results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["stale"] is not None and result["stale"]["type"] == \
            "ConfigurationError", (rank, result["stale"])
    assert not failures(results, "get")
    assert not failures(results, "values")


def test_load_pre_hooks_see_the_whole_dict_once_as_a_plain_optimizer_s(
        results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["seen"] == ([9], [9]), (rank, result["seen"])
    assert not failures(results, "hooked")


def test_two_sharded_optimizers_on_overlapping_subgroups(results: list[dict]) -> None:
    assert not failures(results, "subgroups")


def test_the_optimizer_used_after_its_process_group_was_destroyed_is_refused(
        results: list[dict]) -> None:
    for rank, result in enumerate(results):
        for name in ("destroyed: backward", "destroyed: consolidate"):
            error = result[name]
            assert error is not None and error["type"] == "ConfigurationError", (rank, error)
            assert "destroy_process_group" in error["message"], error
    assert not failures(results, "destroyed: nothing stepped")


def test_param_groups_reordered_on_one_rank_are_named_at_the_gathering(
        results: list[dict]) -> None:
    assert not failures(results, "reordered: values")  # the steps follow the order
    for rank, result in enumerate(results):
        error = result["reordered: refused"]
        assert error is not None and error["type"] == "ConfigurationError", (rank, error)
        assert "in different orders" in error["message"], (rank, error)
        assert "ranks [0] and [1, 2]" in error["message"], (rank, error)
        assert "different optimizers" not in error["message"], (rank, error)
    assert results[0]["reordered: gathered"], results[0]["reordered: gathered"]
