"""Checkpoints of sharded optimizer state (``overlap_ddp(..., shard_optimizer_state=True)``):
``overlapkit.checkpoint`` saved from 2 ranks loads at 1, 2 and 3 ranks into a sharded
optimizer (each rank reading and keeping its share, a rank owning nothing included) and
into a plain one, and a plain optimizer's checkpoint into a sharded one, bitwise, and
training resumes bitwise; the whole state dict gathered for ``torch.save`` loads
anywhere; a rank's own share loads only at the world size it was saved at."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sharded_checkpoint_ranks import SOURCES, TARGETS, compare_loaded, load_run, save_run

from overlapkit.distributed import run_distributed

COMBINATIONS = [f"{source} -> {target}" for source in SOURCES for target in TARGETS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("sharded-checkpoints")
    out: dict[Any, list[dict[str, Any]]] = {
        "saved": run_distributed(save_run, 2, args=(str(directory),), timeout=300)}
    for ranks in (1, 2, 3):
        out[ranks] = run_distributed(load_run, ranks, args=(str(directory),), timeout=300)
    assert not list(Path(directory).glob(".*"))  # every save moved into place
    return out


def _source(combination: str) -> str:
    return combination.split(" -> ")[0]


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("combination", COMBINATIONS)
def test_a_checkpoint_loads_bitwise_at_any_world_size(
        runs: dict[Any, list[dict[str, Any]]], ranks: int, combination: str) -> None:
    saved = runs["saved"]
    for rank, result in enumerate(runs[ranks]):
        loaded = result[combination]
        found = compare_loaded(saved[min(rank, 1)][_source(combination)], loaded["loaded"],
                               rank)
        assert found["values"], (rank, found["values"])
        assert found["state"], (rank, found["state"])
        assert loaded["held only its share"], rank


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("combination", COMBINATIONS)
def test_training_resumes_bitwise(runs: dict[Any, list[dict[str, Any]]], ranks: int,
                                  combination: str) -> None:
    from helpers import compare

    for rank, result in enumerate(runs[ranks]):
        if ranks == 2:  # the uninterrupted run of the saving world size
            expected = runs["saved"][rank]["uninterrupted"]
        else:  # at another world size: the plain optimizer resumed there
            expected = result["plain -> plain"]["after"]
        assert compare(expected, result[combination]["after"]), (rank, combination)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_gathered_state_dict_loads_at_any_world_size(
        runs: dict[Any, list[dict[str, Any]]], ranks: int) -> None:
    saved = runs["saved"]
    for rank, result in enumerate(runs[ranks]):
        found = compare_loaded(saved[min(rank, 1)]["sharded"],
                               result["whole.pt -> sharded"]["loaded"], rank)
        assert found["values"], (rank, found["values"])
        assert found["state"], (rank, found["state"])


def test_each_rank_saved_only_its_share(runs: dict[Any, list[dict[str, Any]]]) -> None:
    assert all(result["saved share"] for result in runs["saved"])


def test_a_share_loads_at_its_world_size(runs: dict[Any, list[dict[str, Any]]]) -> None:
    saved = runs["saved"]
    for rank, result in enumerate(runs[2]):
        assert result["share"]["error"] is None, result["share"]["error"]
        found = compare_loaded(saved[rank]["sharded"], result["share"]["loaded"], rank)
        assert found["values"] and found["state"], (rank, found)


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_share_is_refused_at_another_world_size(
        runs: dict[Any, list[dict[str, Any]]], ranks: int) -> None:
    for result in runs[ranks]:
        error = result["share"]["error"]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "of 2 ranks" in error["message"], error
        assert f"cannot be loaded at {ranks} ranks" in error["message"], error
        assert result["share"]["still fresh"]  # refused before anything changed
