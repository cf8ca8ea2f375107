"""State-dict hooks registered on a sharded optimizer are handed that optimizer (as a
plain optimizer's are handed ``self``), and torch's initialising step
(``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` on an optimizer without
state) is taken by each rank alone, at 2 and 3 gloo ranks (one run each), against plain
DDP + the plain optimizer; the gathered state dict handed out afresh each time; and the
plain loop's dict holding frozen parameters refused clearly (or loaded with
``params=``).

Was (0.4.x): the hooks were handed the real optimizer inside, whose ``state`` is a
``defaultdict`` of this rank's share: a post-hook logging every parameter's step stored
empty entries for the other ranks' parameters, and torch's ``set_optimizer_state_dict``
then skipped its initialising step on rank 0 alone, rank 1 waiting for it until the
group's timeout (6.0 s at a 5 s timeout, ``ExchangeFailedError``); a load post-hook's
read raised a bare ``KeyError: 'step'``. And torch's ``get_optimizer_state_dict`` on
rank 0 alone before the first step waited for the other ranks in the exchange until the
timeout (5.1 s at 5 s), the process group unusable after."""

from __future__ import annotations

import pytest
import sharded_handover_ranks as ranks_
from helpers import failures

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module", params=[2, 3])
def results(request: pytest.FixtureRequest) -> list[dict]:
    return run_distributed(ranks_.hooks, request.param, timeout=300)


def test_state_dict_hooks_are_handed_the_sharded_optimizer_and_store_nothing(
        results: list[dict]) -> None:
    hooks = [result["hooks"] for result in results]
    for rank, result in enumerate(hooks):
        assert result["set"] is None, (rank, result["set"])
        assert result["seconds"] < ranks_.TIMEOUT_SECONDS, (rank, result["seconds"])
        held, owned = result["held after hook"]
        # the hook's reads stored entries of this rank's parameters only (a plain
        # optimizer's store every parameter's)
        assert held <= owned, (rank, result["held after hook"])
        assert result["handed"] and all(result["handed"]), (rank, result["handed"])
        assert all(result["plain handed"]), rank
        # an entry of another rank's parameter names its owner (a KeyError still)
        assert result["plain read errors"] == [], rank
        assert set(result["read errors"]) == {"OwnedElsewhereError"}, result["read errors"]
        logged, owned = result["logged"]
        assert logged == owned, (rank, result["logged"])
        held, owned = result["held"]
        assert held == owned, (rank, result["held"])
    assert hooks[0]["whole logged"] is not None
    assert not failures(hooks, "state")
    assert not failures(hooks, "values")


def test_torch_s_get_on_one_rank_before_the_first_step_leaves_no_rank_waiting(
        results: list[dict]) -> None:
    ones = [result["one rank"] for result in results]
    got = ones[0]["get"]
    # refused at once, as without a gathering on every rank (plain: returned)
    assert got is not None and got["type"] == "ConfigurationError", got
    assert "consolidate_state_dict" in got["message"]
    for rank, result in enumerate(ones):
        assert result["seconds"] < ranks_.TIMEOUT_SECONDS, (rank, result["seconds"])
        assert result["barrier"] is None and result["trained"] is None, (rank, result)
    assert not failures(ones, "values")
    assert not failures(ones, "state")


def test_an_initialising_step_that_changes_parameters_is_refused_and_put_back(
        results: list[dict]) -> None:
    for rank, result in enumerate(results):
        result = result["one rank"]
        shrunk = result["shrunk"]
        if result["owns"]:
            assert shrunk is not None and shrunk["type"] == "ConfigurationError", shrunk
            assert "put back" in shrunk["message"]
        assert result["put back"], (rank, result["put back"])


def test_the_gathered_dict_is_handed_out_afresh_each_time(results: list[dict]) -> None:
    # was: keyed by parameter names after torch's get (a plain optimizer loading it
    # got no state: Adam restarted), and without an entry the loop deleted from an
    # earlier state_dict()'s dict
    result = results[0]["handed out"]
    for case in ("named", "after get", "after del", "plain loaded", "numpy state"):
        assert result[case], (case, result[case])


def test_consolidate_takes_the_integers_zero_redundancy_optimizer_takes(
        results: list[dict]) -> None:
    # was: ConfigurationError "takes a rank from 0 to 1 ..., got np.int64(0)"
    for rank, result in enumerate(results):
        assert result["handed out"]["numpy to"] is None, (rank, result["handed out"])
        assert result["handed out"]["tensor to"] is None, (rank, result["handed out"])


def test_a_plain_dict_holding_frozen_parameters_is_refused_naming_them_or_loads(
        results: list[dict]) -> None:
    for rank, result in enumerate(results):
        result = result["frozen"]
        # was: torch's bare ValueError ("... doesn't match the size of optimizer's group")
        refused = result["refused"]
        assert refused is not None and refused["type"] == "ConfigurationError", refused
        assert "'frozen.weight'" in refused["message"] and "params=" in refused["message"]
        assert result["unchanged"], (rank, result["unchanged"])
    assert not failures([r["frozen"] for r in results], "values")
