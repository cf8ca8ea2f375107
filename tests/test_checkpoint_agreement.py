"""One rank alone refusing a save or load (a path missing on its node, another
optimizer, other shapes, a bad argument, damage in a file only rank 0 checksums) is a
CheckpointError on every rank at once — never the other ranks waiting in DCP's next
collective until the process group times out — and nothing changes anywhere (2 gloo
ranks, real files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from checkpoint_agreement_ranks import CASES, run

from overlapkit.distributed import run_distributed

#: what the refusing rank says (the others quote it)
SAID = {
    "missing path on rank 1": "no checkpoint at",
    "other optimizer on rank 1": "different optimizer",
    "other shapes on rank 1": "has shape",
    "bad save argument on rank 1": "optimizer must be a torch.optim.Optimizer",
    "damaged file only rank 0 checksums": "other contents",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory: Path = tmp_path_factory.mktemp("agreement")
    # a timeout far below the process group's: a rank left waiting fails the test
    return run_distributed(run, 2, args=(str(directory),), timeout=120)


@pytest.mark.parametrize("case", CASES)
def test_every_rank_raises_at_once_and_nothing_changes(results: list[dict[str, Any]],
                                                       case: str) -> None:
    refusing = 0 if "rank 0" in case else 1
    for rank, rank_results in enumerate(results):
        result = rank_results[case]
        error = result["error"]
        assert error is not None and error["type"] == "CheckpointError", (rank, error)
        assert SAID[case] in error["message"], (rank, error)
        if rank != refusing:
            assert f"refused on rank {refusing}" in error["message"], error
        assert result["seconds"] < 20, result["seconds"]
        assert result["unchanged"], (rank, result["unchanged"])
        assert result["files unchanged"]
