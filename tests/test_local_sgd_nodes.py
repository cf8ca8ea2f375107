"""Post-local SGD across nodes: the hierarchy taken from the launch, bitwise the same
groups given explicitly; launches that do not fit it refused before training; state
saved after local steps began refused at another world size.

The ranks here are ``run_distributed``'s, given the environment torchrun gives the
ranks of several nodes (``GROUP_RANK``, ``LOCAL_WORLD_SIZE``, ...);
``tests/test_nodes.py`` runs the same under real torchrun agents.
"""

from __future__ import annotations

from typing import Any

import nodes_ranks
import pytest
import torch
from helpers import compare

from overlapkit.distributed import run_distributed

TIMEOUT = 240


@pytest.fixture(scope="module")
def two_nodes_of_two() -> list[dict[str, Any]]:
    return run_distributed(nodes_ranks.hierarchy, 4, args=([2, 2],), timeout=TIMEOUT)


def test_the_hierarchy_from_the_launch_is_each_node_then_every_rank(
    two_nodes_of_two: list[dict[str, Any]],
) -> None:
    for run in two_nodes_of_two:
        assert run["plan"] == {1: 2, 4: 4}  # node_period = period // 4
        assert run["hook_subgroup"] is None  # each rank steps alone between averagings
        assert run["node_period_3"] == {3: 2, 8: 4}
        assert run["created"] == {2: 2, 8: 4}
    groups = [run["node_group"][1] for run in two_nodes_of_two]
    assert groups == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_the_hierarchy_from_the_launch_is_bitwise_the_explicit_one(
    two_nodes_of_two: list[dict[str, Any]],
) -> None:
    for rank, run in enumerate(two_nodes_of_two):
        same = compare(run["explicit"], run["from_launch"])
        assert same, f"rank {rank}: {same}"
    # it did average: the nodes drift apart between global averagings, then meet
    first, last = two_nodes_of_two[0]["from_launch"], two_nodes_of_two[3]["from_launch"]
    assert torch.equal(first[2], two_nodes_of_two[1]["from_launch"][2])  # node step
    assert not torch.equal(first[2], last[2])
    assert torch.equal(first[4], last[4])  # step 4: every rank


@pytest.fixture(scope="module")
def uneven_nodes() -> list[dict[str, Any]]:
    return run_distributed(nodes_ranks.bad_launch, 4, args=([1, 3],), timeout=TIMEOUT)


@pytest.mark.parametrize(("case", "says"), [
    ("from_launch", "the nodes run different numbers of ranks"),
    ("default_subgroup", "the nodes run different numbers of ranks (LOCAL_WORLD_SIZE 1 on "
                         "ranks [0]; 3 on ranks [1, 2, 3])"),
    ("node_period_too_large", "node_period must be an integer from 1 to period - 1 = 3"),
    ("both_plans", "pass one of them"),
])
def test_a_launch_of_unequal_nodes_is_refused_on_every_rank(
    uneven_nodes: list[dict[str, Any]], case: str, says: str,
) -> None:
    for run in uneven_nodes:
        error = run[case]
        assert error is not None and error["type"] == "ConfigurationError"
        assert error["overlapkit"] and says in error["message"]
        assert run["in_step"] == 4


def test_a_plan_whose_groups_straddle_nodes_is_refused() -> None:
    runs = run_distributed(nodes_ranks.bad_launch, 6, args=([2, 2, 2],), timeout=TIMEOUT)
    for run in runs:
        error = run["straddling_plan"]
        assert error is not None and error["type"] == "ConfigurationError"
        assert "a group of 3 ranks (ranks 0-2) takes part of one node and part of another" \
            in error["message"]
        assert "here one of [1, 2, 6]" in error["message"]
        assert run["from_launch"] is None and run["default_subgroup"] is None
        assert run["in_step"] == 6


def test_local_sgd_state_after_warmup_is_refused_at_another_world_size() -> None:
    states = run_distributed(nodes_ranks.local_sgd_states, 4, timeout=TIMEOUT)[0]
    assert states["after_warmup"]["world_size"] == 4
    runs = run_distributed(nodes_ranks.reshard_local_sgd_state, 2, timeout=TIMEOUT,
                           args=(states["after_warmup"], states["during_warmup"]))
    for run in runs:
        error = run["after_warmup"]
        assert error is not None and error["type"] == "CheckpointError" and error["overlapkit"]
        assert "saved by one of 4 ranks after local SGD began" in error["message"]
        assert "cannot be resharded to 2 ranks" in error["message"]
        assert run["unchanged"] and run["averager_step"] == 0
        assert run["during_warmup_step"] == 2
