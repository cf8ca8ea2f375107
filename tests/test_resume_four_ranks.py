"""A resumed run ends bitwise where the uninterrupted run ends on four ranks too, where
DDP's bucket layout decides the order in which the ranks' gradients are added
(overlapkit.checkpoint.ddp_buckets): the checkpoint carries the layout DDP chose after
its first backward, and the load lays the fresh model's buckets out the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import failures
from resume_four_ranks import run

from overlapkit.distributed import run_distributed

OVERLAPPED = ["overlap_ddp", "clipped", "optimizer_in_backward", "sharded"]
TECHNIQUES = ["plain", *OVERLAPPED]
KINDS = ["readme", "out-of-order", "bucket-views"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory: Path = tmp_path_factory.mktemp("resume-four")
    return run_distributed(run, 4, args=(str(directory),), timeout=300)


@pytest.mark.parametrize("technique", TECHNIQUES)
@pytest.mark.parametrize("kind", KINDS)
def test_the_resumed_run_ends_bitwise_where_the_uninterrupted_one_ends(
        results: list[dict[str, Any]], kind: str, technique: str) -> None:
    assert failures(results, f"{kind} {technique}") == {}


@pytest.mark.parametrize("kind", KINDS)
def test_without_the_layout_the_resumed_run_differs(results: list[dict[str, Any]],
                                                    kind: str) -> None:
    """What the layout fixes, so that the test above can fail: plain DDP resumed
    through torch's own ``load_state_dict`` sums the first step's gradients in DDP's
    first layout, and ends elsewhere (torch 2.13: ~3e-8 off)."""
    assert all(not r[f"{kind} torch's load"] for r in results)


@pytest.mark.parametrize("technique", TECHNIQUES)
@pytest.mark.parametrize("kind", KINDS)
def test_the_layout_is_saved_and_saved_again_after_a_resume(
        results: list[dict[str, Any]], kind: str, technique: str) -> None:
    assert all(r[f"{kind} {technique} layout saved"] for r in results)
    assert all(r[f"{kind} {technique} layout saved again"] for r in results)


@pytest.mark.parametrize("technique", TECHNIQUES)
@pytest.mark.parametrize("kind", KINDS)
def test_the_load_leaves_the_gradients_as_they_were(results: list[dict[str, Any]],
                                                    kind: str, technique: str) -> None:
    assert all(r[f"{kind} {technique} grads kept"] for r in results)


def test_where_ddp_keeps_its_own_layout_the_saved_one_is_not_replayed(
        results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["kept"] == {
            "find_unused_parameters": False, "static_graph": False,
            "PowerSGD": (False, 0),  # its state did not see a backward
            "torch's allreduce_hook": True,
            "no_sync": False, "laid out": True, "laid out again": False,
            "not DDP": False,
        }
