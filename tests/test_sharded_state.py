"""``overlap_ddp(..., shard_optimizer_state=True)`` (ZeRO-1 with the overlapped step):
bitwise plain DDP + the same optimizer from the first iteration, with every dense
``torch.optim`` optimizer, param groups, an LR scheduler, global and value clipping, a
GradScaler skipping a step, ``no_sync()`` accumulation, full steps, ``static_graph``,
``gradient_as_bucket_view`` and the loop shapes; optimizer state per rank within
``total / world_size + the largest parameter's``; a delayed parameter exchange is waited
for; bad input is refused before anything changes. On 2 and 3 gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
from sharded_refusal_ranks import REFUSED_SETUPS, refusals
from sharded_state_ranks import CASES, CASES_AT_3, READERS, delayed_exchanges, run_cases

from overlapkit.distributed import run_distributed

PARAMS = [pytest.param(2, name, id=f"2 ranks | {name}") for name in CASES] + [
    pytest.param(3, name, id=f"3 ranks | {name}") for name in CASES_AT_3]


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, Any]]]:
    return {ranks: run_distributed(run_cases, ranks, timeout=600) for ranks in (2, 3)}


@pytest.mark.parametrize(("ranks", "case"), PARAMS)
def test_sharded_training_is_bitwise_plain_ddp(results: dict[int, list[dict[str, Any]]],
                                               ranks: int, case: str) -> None:
    for rank, rank_results in enumerate(results[ranks]):
        result = rank_results[case]
        assert result["first iteration"], (rank, result["first iteration"])
        assert result["losses"], (rank, result["losses"])  # each forward saw the updates
        assert result["values"], (rank, result["values"])
        # .grad read after the step is the plain loop's (clipped on every parameter,
        # not only on this rank's share)
        assert result["grads"], (rank, result["grads"])
        assert result["state"], (rank, result["state"])  # gathered: the plain state
        assert result["trained"], rank


@pytest.mark.parametrize(("ranks", "case"), PARAMS)
def test_each_rank_keeps_only_its_share_of_the_state(
        results: dict[int, list[dict[str, Any]]], ranks: int, case: str) -> None:
    for rank, rank_results in enumerate(results[ranks]):
        result = rank_results[case]
        assert result["no state outside the share"], rank
        if result["bound"] is not None:
            assert result["state bytes"] <= result["bound"], (rank, result)
    if case == "a policy giving rank 0 nothing":
        assert [r[case]["owned"] for r in results[ranks]][:-1] == [0] * (ranks - 1)


@pytest.fixture(scope="module")
def delayed() -> dict[int, dict[str, list[dict[str, Any]]]]:
    out = {}
    for ranks in (2, 3):
        per_rank = run_distributed(delayed_exchanges, ranks, timeout=300)
        out[ranks] = {reader: [results[reader] for results in per_rank]
                      for reader in READERS}
    return out


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("reader", READERS)
def test_a_delayed_exchange_is_waited_for(
        delayed: dict[int, dict[str, list[dict[str, Any]]]], reader: str, ranks: int) -> None:
    for rank, result in enumerate(delayed[ranks][reader]):
        assert result["losses"], (rank, result["losses"])  # forwards saw every update
        assert result["values"], (rank, result["values"])
    # rank 1 reached the reader with rank 0's updates still on the way: the wait was
    # needed, and the values above show that it held
    waited = delayed[ranks][reader][1]["waited"]
    assert any(count > 0 for count in waited), waited


@pytest.fixture(scope="module")
def refused() -> dict[int, list[dict[str, Any]]]:
    return {ranks: run_distributed(refusals, ranks, timeout=300) for ranks in (2, 3)}


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("case", list(REFUSED_SETUPS))
def test_bad_input_is_refused_before_anything_changes(
        refused: dict[int, list[dict[str, Any]]], case: str, ranks: int) -> None:
    for rank, rank_results in enumerate(refused[ranks]):
        result = rank_results[case]
        assert result["error"] is not None and result["error"]["overlapkit"], (rank, result)
        assert result["unchanged"], (rank, result["after"])
    expected = {"find_unused_parameters": "find_unused_parameters",
                "step_thread='comm'": "step_thread",
                "clip_grad_norm_scope='bucket'": "its share's",
                "LBFGS": "closure",
                "an optimizer writing into its param groups": "'d'",
                "an optimizer with state that is no parameter's": "no single parameter",
                "a policy answering per rank": "differently on ranks",
                "a policy answering too few owners": "1 owners for",
                "a policy answering a rank out of range":
                    f"owners are ranks from 0 to {ranks - 1}",
                "shard_optimizer_state='yes'": "must be True, False",
                "shard_optimizer_state=the policy class": "pass an instance"}[case]
    error = refused[ranks][0][case]["error"]
    assert expected in error["message"], error


@pytest.mark.parametrize("ranks", [2, 3])
def test_state_dict_needs_a_current_gathering_on_this_rank(
        refused: dict[int, list[dict[str, Any]]], ranks: int) -> None:
    results = [r["state dicts"] for r in refused[ranks]]
    for result in results:
        assert "consolidate_state_dict(to=" in result["not gathered"]["message"]
        assert result["bad rank"]["type"] == "ConfigurationError"
    assert results[0]["gathered here"] is None
    for result in results[1:]:
        assert "gathered on rank 0" in result["gathered elsewhere"]["message"]
    assert "stale" in results[0]["stale"]["message"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_share_loads_only_on_its_own_rank(refused: dict[int, list[dict[str, Any]]],
                                            ranks: int) -> None:
    for rank, result in enumerate(r["state dicts"] for r in refused[ranks]):
        message = result["another rank's share"]["message"]
        assert "share and is being loaded on rank" in message, message
        assert result["state unchanged"], rank
        assert result["own share"] is None, result["own share"]
        assert result["not a state dict"]["type"] == "ConfigurationError"
        # a plain optimizer fails at once rather than loading one share silently
        assert result["plain optimizer refuses a share"] is not None


#: who owns the five parameters added as a second group (after the four weights): the
#: ranks owning the fewest bytes (computed from the sizes: see SizeBalancedPolicy)
ADDED_OWNERS = {2: {0, 1}, 3: {2}}


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_param_group_added_later_is_sharded_and_trained_bitwise(
        refused: dict[int, list[dict[str, Any]]], ranks: int) -> None:
    results = [r["added group"] for r in refused[ranks]]
    for rank, result in enumerate(results):
        assert result["values"], (rank, result["values"])
        assert result["held"], rank  # state only for its share, the new group's included
        assert result["owners"] == results[0]["owners"]  # the ranks agree
    assert set(results[0]["owners"][-5:]) == ADDED_OWNERS[ranks], results[0]["owners"]
