"""A sharded optimizer (``overlap_ddp(..., shard_optimizer_state=True)``) over a DDP
model on a subgroup the loop destroyed (``dist.destroy_process_group(subgroup)``) while
training on: the gathering and ``overlapkit.checkpoint`` are refused with what to do,
nothing gathered, written or loaded, and training goes on bitwise plain DDP, on 2 gloo
ranks (``overlap/sharded/model_group.py``); with the plain optimizer or ``overlap_ddp``
unsharded, the checkpoint is refused alike (``checkpoint/arguments.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import sharded_model_group_ranks as ranks_
from helpers import failures

from overlapkit.distributed import run_distributed


def test_a_destroyed_ddp_subgroup_refuses_the_gathering_and_checkpoints_before_anything(
        tmp_path: Path) -> None:
    results = run_distributed(ranks_.subgroup_destroyed, 2, args=(str(tmp_path),),
                              timeout=300)
    for rank, result in enumerate(results):
        for name in ("consolidate", "save", "load"):
            error = result[name]
            assert error is not None and error["type"] == "ConfigurationError", (rank, name,
                                                                                 error)
            assert "destroy_process_group" in error["message"], error
            assert "torch.distributed.checkpoint.save" in error["message"], error
        assert not result["written"], rank
        assert result["load left lr"], rank
    for key in ("unchanged", "state unchanged", "values"):
        assert not failures(results, key), key


def test_at_one_rank_a_destroyed_subgroup_still_gathers_and_saves(tmp_path: Path) -> None:
    (result,) = run_distributed(ranks_.one_rank_subgroup_destroyed, 1,
                                args=(str(tmp_path),), timeout=120)
    assert result == {"consolidate": None, "save": None}, result


@pytest.mark.parametrize("technique", ["plain", "overlap_ddp"])
def test_a_destroyed_ddp_subgroup_refuses_the_checkpoint_of_an_unsharded_optimizer(
        tmp_path: Path, technique: str) -> None:
    results = run_distributed(ranks_.unsharded_subgroup_destroyed, 2,
                              args=(str(tmp_path), technique), timeout=300)
    for rank, result in enumerate(results):
        for name in ("save", "load"):
            error = result[name]
            assert error is not None and error["type"] == "CheckpointError", (rank, name,
                                                                              error)
            assert "destroy_process_group" in error["message"], error
            assert "Nothing was written or changed" in error["message"], error
        assert not result["written"], rank
        assert result["load left lr"], rank
    for key in ("unchanged", "values"):
        assert not failures(results, key), key
