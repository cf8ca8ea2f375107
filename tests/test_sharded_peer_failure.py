"""A rank that fails mid-backward under ``overlap_ddp`` (issue 31, case 4), on 2 gloo
ranks (and 3 once), sharded and not, stepping on the thread running backward, the comm
thread, or after backward (global clipping): the other ranks raise an overlapkit error that
names it and says what to do, at about the DDP group's timeout (plain DDP raises gloo's
bare timeout then), never a hang, never torch's "Got the following error when running
the callback". A rank that raises and stays alive, or stalls past the timeout:
``ExchangeFailedError``; a rank killed: ``RanksLostError``.

Each rank is a process of its own (tests/sharded_peer_failure_ranks.py): a rank killed
with SIGKILL would make ``run_distributed`` stop the others before they report.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import overlapkit
from overlapkit.distributed import free_port
from overlapkit.errors import ExchangeFailedError, RanksLostError
from overlapkit.nodes.failed_collective import collective_failure
from overlapkit.nodes.roll_call import HEARTBEAT_SECONDS, ROLL_CALL_SECONDS

RANKS = Path(__file__).with_name("sharded_peer_failure_ranks.py")
#: the DDP model's process-group timeout, s
TIMEOUT = 5.0
#: room for a loaded machine on top of the expected figures, s
SLACK = 3.0
#: torch's words when a comm hook's callback raised: never in an overlapkit error
CALLBACK = "Got the following error when running the callback"


def _launch(technique: str, failure: str, directory: Path,
            world_size: int = 2) -> list[dict[str, Any] | None]:
    """Start the ranks, wait for them (killing what is left at the deadline), and
    return each rank's result (None: it wrote none)."""
    package = Path(overlapkit.__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")])}
    port = free_port()
    procs = []
    for rank in range(world_size):
        with (directory / f"rank{rank}.log").open("wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(RANKS), str(rank), str(world_size), str(port),
                 technique, failure, str(TIMEOUT), str(directory)],
                stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + 150
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for rank in range(world_size):
        path = directory / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    assert results[0] is not None, (directory / "rank0.log").read_text()[-4000:]
    return results


def _overlapkit_error(seen: dict[str, Any] | None, rank: int, directory: Path) -> None:
    assert seen is not None, (directory / f"rank{rank}.log").read_text()[-4000:]
    assert seen["module"] == "overlapkit.errors", seen  # not torch's RuntimeError
    assert CALLBACK not in seen["message"], seen["message"]


def _raised_again(result: dict[str, Any], directory: Path) -> None:
    """Sharded: the next forward and ``step()`` raise the same error at once."""
    for then in ("next forward", "next step"):
        _overlapkit_error(result[then], 0, directory)
        assert result[then]["message"] == result["error"]["message"], (then, result)
        assert result[then]["seconds"] < 1.0, (then, result[then])


@pytest.mark.parametrize(("technique", "failure"), [
    ("sharded", "raises"), ("unsharded", "raises"), ("sharded", "stalls"),
    ("unsharded", "stalls"), ("comm", "raises"), ("clipped", "raises")])
def test_a_rank_that_stops_taking_part_is_named_at_the_groups_timeout(
        technique: str, failure: str, tmp_path: Path) -> None:
    results = _launch(technique, failure, tmp_path)
    seen = results[0]["error"]  # type: ignore[index]
    _overlapkit_error(seen, 0, tmp_path)
    assert seen["type"] == "ExchangeFailedError", seen
    assert seen["silent"] == [1], seen
    message = seen["message"]
    assert message.startswith("reducing gradient bucket"), message
    assert "failed on rank 0: rank 1 is alive" in message, message
    assert f"process group's timeout ({TIMEOUT:g} s)" in message, message
    assert "restart the job" in message, message
    # plain DDP raises at the timeout; the roll call then ends at rank 1's next beat
    assert TIMEOUT - 0.5 <= seen["seconds"] <= TIMEOUT + HEARTBEAT_SECONDS + SLACK, seen
    if technique in ("sharded", "clipped"):  # the parameters are not all updated: never used
        _raised_again(results[0], tmp_path)  # type: ignore[arg-type]
    if failure == "stalls":  # the stalled rank, once it goes on, is told too
        _overlapkit_error(results[1] and results[1]["error"], 1, tmp_path)


def test_at_three_ranks_every_survivor_names_the_rank_that_raised(tmp_path: Path) -> None:
    results = _launch("sharded", "raises", tmp_path, world_size=3)
    for rank in (0, 2):
        seen = results[rank]["error"]  # type: ignore[index]
        _overlapkit_error(seen, rank, tmp_path)
        assert seen["type"] == "ExchangeFailedError" and seen["silent"] == [1], seen
        assert f"failed on rank {rank}: rank 1 is alive" in seen["message"], seen
        assert TIMEOUT - 0.5 <= seen["seconds"] <= TIMEOUT + HEARTBEAT_SECONDS + SLACK, seen


def test_a_rank_that_skips_a_full_step_is_named_at_the_exchange_s_timeout(
        tmp_path: Path) -> None:
    results = _launch("sharded", "skips_step", tmp_path)
    assert results[0]["exchange timeout"] == TIMEOUT, results[0]  # type: ignore[index]
    seen = results[0]["error"]  # type: ignore[index]
    _overlapkit_error(seen, 0, tmp_path)
    assert seen["type"] == "ExchangeFailedError" and seen["silent"] == [1], seen
    message = seen["message"]
    assert message.startswith("exchanging the updated parameters (sharded optimizer "
                              "state) failed on rank 0: rank 1 is alive"), message
    assert f"process group's timeout ({TIMEOUT:g} s)" in message, message
    assert TIMEOUT - 0.5 <= seen["seconds"] <= TIMEOUT + HEARTBEAT_SECONDS + SLACK, seen
    _raised_again(results[0], tmp_path)  # type: ignore[arg-type]


@pytest.mark.parametrize("technique", ["sharded", "unsharded"])
def test_a_rank_killed_mid_backward_is_named_lost_within_the_roll_call(
        technique: str, tmp_path: Path) -> None:
    results = _launch(technique, "killed", tmp_path)
    seen = results[0]["error"]  # type: ignore[index]
    _overlapkit_error(seen, 0, tmp_path)
    assert seen["type"] == "RanksLostError", seen
    assert seen["lost"] == [1], seen
    assert "rank 1" in seen["message"] and "was lost" in seen["message"], seen
    # gloo fails at once (the connection is reset); the roll call waits for rank 1
    assert seen["seconds"] <= ROLL_CALL_SECONDS + SLACK < TIMEOUT + ROLL_CALL_SECONDS, seen
    if technique == "sharded":
        _raised_again(results[0], tmp_path)  # type: ignore[arg-type]


def test_torch_s_callback_wrapping_of_a_gloo_timeout_becomes_one_overlapkit_error() -> None:
    raw = RuntimeError(f"{CALLBACK}: RuntimeError: Application timeout caused pair closure"
                       "\n\nAt:\n  overlapkit/nodes/lost_ranks.py(226): reduced_tensor\n")
    error = collective_failure(raw, "reducing gradient bucket 3 (DDP comm hook of overlap_ddp)")
    assert isinstance(error, ExchangeFailedError) and error.__cause__ is raw
    message = str(error)
    assert message.startswith("reducing gradient bucket 3 (DDP comm hook of overlap_ddp) "
                              "failed on rank 0"), message
    assert "The transport said: Application timeout caused pair closure." in message, message
    assert CALLBACK not in message and "restart the job" in message, message
    assert pickle.loads(pickle.dumps(error)).silent == error.silent


def test_a_lost_rank_named_inside_a_callback_keeps_its_type() -> None:
    named = ("rank 1 (host h) was lost while reducing a gradient bucket (DDP comm hook): "
             "this rank's collective failed (Connection reset by peer) ...")
    raw = RuntimeError(f"{CALLBACK}: RanksLostError: {named}\n\nAt:\n  reduced_tensor\n")
    error = collective_failure(raw, "reducing gradient bucket 3")
    assert isinstance(error, RanksLostError) and str(error) == named


def test_an_error_of_this_rank_s_own_is_left_as_it_is() -> None:
    assert collective_failure(ValueError("bad shape"), "reducing gradient bucket 3") is None
