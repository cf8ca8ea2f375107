"""The views and the lifecycle of ``overlap_ddp(..., shard_optimizer_state=True)``
(issue 31, cases 1-7), on 2 and 3 gloo ranks: reads of ``opt.state[p]`` on ranks not
owning ``p`` leave the gathered state the plain optimizer's; ``state_dict()`` has the
current param groups; parameters added later are under the late-clipping guard; a stale
gathered state is released; nothing (threads, file descriptors, process groups) is left
behind; state-dict hooks round-trip as a plain optimizer's."""

from __future__ import annotations

from typing import Any

import pytest
import sharded_lifecycle_ranks as ranks_
from helpers import failures

from overlapkit.distributed import run_distributed

WORLD_SIZES = [2, 3]


def _run(fn: Any, world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    return run_distributed(fn, world_size, args=args, timeout=timeout)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reading_state_on_a_rank_not_owning_the_parameter_leaves_the_gathered_state_whole(
        world_size: int) -> None:
    results = _run(ranks_.reads_of_state, world_size)
    assert results[0]["missing entries"] == 0, results[0]["missing entries"]
    assert results[0]["gathered"], results[0]["gathered"]
    assert not failures(results, "resumed")  # resumed bitwise as the plain optimizer
    if world_size == 2:
        assert not failures(results, "uninterrupted")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_state_dict_after_a_scheduler_step_has_the_current_lr(world_size: int) -> None:
    result = _run(ranks_.groups_after_scheduler, world_size)[0]
    given, held = result["lr"]
    assert given == held, result["lr"]
    assert result["state dict"], result["state dict"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_clip_of_parameters_added_later_is_answered_or_refused(world_size: int) -> None:
    for rank, result in enumerate(_run(ranks_.clip_after_add_param_group, world_size)):
        assert result["answered"] is None, (rank, result["answered"])
        assert result["norms"], (rank, result["norms"])
        assert result["values"], (rank, result["values"])
        refused = result["refused"]
        assert refused is not None and refused["type"] == "ConfigurationError", refused
        assert "max_norm=0.01" in refused["message"], refused
        assert result["unchanged"], (rank, result["unchanged"])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("how", ["dropped", "plain"])
def test_building_and_dropping_ten_times_leaves_nothing_behind(world_size: int,
                                                               how: str) -> None:
    for rank, result in enumerate(_run(ranks_.build_and_drop, world_size, how)):
        assert result["first"] == result["last"], (rank, result)  # threads, fds, groups


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_stale_gathered_state_is_released(world_size: int) -> None:
    result = _run(ranks_.stale_gathering_released, world_size)[0]
    assert result["gathered"] > 0
    assert result["held"] < result["gathered"] / 2, result
    assert "stale" in result["stale"]["message"], result["stale"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_state_dict_hooks_round_trip_as_a_plain_optimizers(world_size: int) -> None:
    for rank, result in enumerate(_run(ranks_.state_dict_hooks, world_size)):
        assert result["whole"] == result["plain"], (rank, result)  # saw the whole state
        assert result["local"] is not None, rank
        assert result["seen"] == result["plain seen"] * 2, (rank, result)
        assert result["state"], (rank, result["state"])


@pytest.mark.parametrize("read", [False, True])
def test_static_graph_first_backward_warns_of_the_loops_reads_only(read: bool) -> None:
    """DDP(static_graph=True) steps everything at the end of its first backward: the
    exchange of the updated parameters there is overlapkit's read, not the loop's (it
    was warned of as the loop's, at its backward() line, with 4b7a286)."""
    for rank, result in enumerate(_run(ranks_.static_graph_reads, 2, read)):
        assert result["params"], (rank, result["params"])
        assert result["warned at"] == ([result["read at"]] if read else []), (rank, result)
