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

#: what each set-up's refusals are, and the words its message must hold
_REFUSED = {
    "sharded": (("consolidate", "save", "load"), "ConfigurationError",
                "torch.distributed.checkpoint.save"),
    "plain": (("save", "load"), "CheckpointError", "Nothing was written or changed"),
    "overlap_ddp": (("save", "load"), "CheckpointError", "Nothing was written or changed"),
}


@pytest.mark.parametrize("technique", list(_REFUSED))
def test_a_destroyed_ddp_subgroup_refuses_the_gathering_and_checkpoints_before_anything(
        tmp_path: Path, technique: str) -> None:
    names, kind, words = _REFUSED[technique]
    results = run_distributed(ranks_.subgroup_destroyed, 2,
                              args=(str(tmp_path), technique), timeout=300)
    for rank, result in enumerate(results):
        for name in names:
            error = result[name]
            assert error is not None and error["type"] == kind, (rank, name, error)
            assert "destroy_process_group" in error["message"], error
            assert words in error["message"], error
        assert not result["written"], rank
        assert result["load left lr"], rank
    keys = ("unchanged", "state unchanged", "values") if technique == "sharded" else (
        "unchanged", "values")
    for key in keys:
        assert not failures(results, key), key


def test_at_one_rank_a_destroyed_subgroup_still_gathers_and_saves(tmp_path: Path) -> None:
    (result,) = run_distributed(ranks_.one_rank_subgroup_destroyed, 1,
                                args=(str(tmp_path),), timeout=120)
    assert result == {"consolidate": None, "save": None}, result
