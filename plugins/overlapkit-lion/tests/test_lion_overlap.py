"""overlap_ddp with Lion on 2 gloo ranks: the plugin's bucket step against plain Lion."""

from __future__ import annotations

from typing import Any

import lion_ranks
import pytest
import torch

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def ranks() -> list[dict[Any, Any]]:
    return run_distributed(lion_ranks.run_all, 2, timeout=180)


@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_overlapped_lion_matches_plain_lion_bitwise(
    ranks: list[dict[Any, Any]], decay: float
) -> None:
    for result in ranks:
        assert torch.equal(result[decay]["ours"], result[decay]["plain"])


def test_the_plugin_flat_bucket_step_is_the_one_used(ranks: list[dict[Any, Any]]) -> None:
    engine, buffers = ranks[0][0.0]["engine"].split(" (")
    assert engine == "LionOverlapped"
    # 6 parameter tensors in fewer flat momentum buffers: one per bucket.
    assert int(buffers.split()[0]) < 6


def test_state_dict_is_plain_lion_format(ranks: list[dict[Any, Any]]) -> None:
    ours, plain = ranks[0][0.1]["our_state"], ranks[0][0.1]["plain_state"]
    assert ours["state"].keys() == plain["state"].keys()
    for index, state in plain["state"].items():
        assert torch.equal(ours["state"][index]["exp_avg"], state["exp_avg"])
    assert torch.equal(ranks[0]["loads_into_plain"], ours["state"][0]["exp_avg"])


def test_blocking_the_plugin_falls_back_to_the_generic_engine() -> None:
    results = run_distributed(lion_ranks.engine_when_blocked, 2, timeout=180,
                              env={"OVERLAPKIT_DISABLE_PLUGINS": "lion"})
    assert results[0]["engine"].startswith("GenericOverlapEngine (6 momentum")
    assert torch.equal(results[0]["ours"], results[0]["plain"])


def test_sharded_lion_matches_plain_lion_bitwise() -> None:
    results = run_distributed(lion_ranks.sharded, 2, timeout=180)
    for result in results:
        assert result["engine"] == "LionOverlapped"
        assert torch.equal(result["ours"], result["plain"])
        assert 0 < result["held"] == result["owned"] < 6  # its share of the momenta
    ours, plain = results[0]["our_state"], results[0]["plain_state"]
    assert ours["state"].keys() == plain["state"].keys()
    for index, state in plain["state"].items():
        assert torch.equal(ours["state"][index]["exp_avg"], state["exp_avg"])
