"""A load that fails leaves the model and optimizer exactly as they were (2 gloo ranks,
real DCP files): a truncated data file, a zeroed header, random bytes in the middle
(all found by the file list written at save, before anything is read; a truncated file
also without the list, from the sizes in DCP's metadata) and a malicious
non-tensor entry (refused while reading the settings, before any tensor is read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from checkpoint_damage_ranks import KINDS, run

from overlapkit.distributed import run_distributed

EXPECTED = {
    "truncated": "truncated",
    "zeroed header": "other contents",
    "random bytes": "other contents",
    "malicious entry": "is not a plain",
    "truncated, no file list": "(truncated)",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory: Path = tmp_path_factory.mktemp("damage")
    return run_distributed(run, 2, args=(str(directory),), timeout=240)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_load_changes_nothing(results: list[dict[str, Any]], kind: str) -> None:
    for rank_results in results:
        result = rank_results[kind]
        assert result["error"] is not None, f"{kind}: loaded"
        assert result["error"]["type"] == "CheckpointError", result["error"]
        assert EXPECTED[kind] in result["error"]["message"], result["error"]
        assert result["unchanged"], result["unchanged"]
        assert result["fresh error"] is not None
        assert result["fresh has no state"]
        assert not result["code ran"]


def test_the_intact_checkpoint_still_loads_exactly(results: list[dict[str, Any]]) -> None:
    assert all(r["good loads"] for r in results)
