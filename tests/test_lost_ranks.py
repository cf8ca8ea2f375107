"""The roll call that names lost ranks (overlapkit.nodes.lost_ranks, .roll_call): which
errors are a peer's failure, who counts as alive (an answer, a heartbeat, a note at
exit) and what the message says. The end-to-end case — a torchrun node killed, its
ranks named by the survivors — is in tests/test_nodes.py."""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

import pytest
import torch.distributed as dist

from overlapkit.distributed import run_distributed
from overlapkit.errors import RanksLostError
from overlapkit.nodes import lost_ranks
from overlapkit.nodes.lost_ranks import _message, is_peer_failure, name_lost_ranks
from overlapkit.nodes.roll_call import Verdict

GLOO = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
        "peer [127.0.0.1]:49306")


class FakeCheckpointException(BaseException):
    """The shape of DCP's CheckpointException: per-rank (exception, traceback) pairs."""

    def __init__(self, failures: dict[int, Any]) -> None:
        super().__init__("CheckpointException ranks:dict_keys([0])")
        self.failures = failures


@pytest.mark.parametrize(("error", "is_loss"), [
    (RuntimeError(GLOO), True),
    (RuntimeError("Timed out waiting 10000ms for recv operation to complete"), True),
    (RuntimeError("Read error [127.0.0.1]:1: Connection reset by peer"), True),
    (FakeCheckpointException({0: (RuntimeError(GLOO), None)}), True),
    (ValueError("a tensor of another shape"), False),
    (RuntimeError("CUDA out of memory"), False),
])
def test_a_peer_failure_is_told_from_other_errors(error: BaseException, is_loss: bool) -> None:
    assert is_peer_failure(error) is is_loss


def test_a_cause_deep_in_the_chain_counts() -> None:
    try:
        try:
            raise RuntimeError(GLOO)
        except RuntimeError as inner:
            raise ValueError("saving failed") from inner
    except ValueError as outer:
        assert is_peer_failure(outer)


def test_without_a_process_group_nothing_is_named() -> None:
    assert name_lost_ranks(RuntimeError(GLOO), "testing") is None


def _verdict(**changes: Any) -> Verdict:
    fields: dict[str, Any] = dict(world=4, answered={0, 1}, beating=set(), left=set(),
                                  nodes={2: "torchrun node 1 on host b",
                                         3: "torchrun node 1 on host b"},
                                  store_error=None, seconds=5.0)
    fields.update(changes)
    return Verdict(**fields)


def test_the_message_names_the_lost_ranks_their_node_and_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setattr(lost_ranks, "last_complete_checkpoint", "ckpt")
    text = _message(_verdict(), "saving the checkpoint to ckpt", RuntimeError(GLOO))
    assert text.startswith("ranks 2, 3 (torchrun node 1 on host b) were lost while saving "
                           "the checkpoint to ckpt: this rank's collective failed ([/pyt")
    assert "Connection closed by peer [127.0.0.1]:49306" in text
    assert "where ranks 0, 1 did" in text and "that checkpoint (ckpt) is intact" in text
    assert "Resume from it: restart the job" in text
    assert "torchrun --max-restarts N" in text
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text


def test_before_any_checkpoint_the_message_says_there_is_none_to_resume_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lost_ranks, "last_complete_checkpoint", None)
    text = _message(_verdict(), "saving the checkpoint to ckpt", RuntimeError(GLOO))
    assert "intact" not in text and "Resume from it" not in text
    assert "has not completed or resumed from a checkpoint" in text
    assert "The checkpoint being written is not complete and will not be taken" in text
    text = _message(_verdict(), "averaging", RuntimeError(GLOO))
    assert "none is there to resume from" in text and "being written" not in text
    assert "Start again: restart the job" in text


def test_ranks_on_several_nodes_and_ranks_that_left_are_told_apart() -> None:
    verdict = _verdict(world=6, answered={0}, left={1},
                       nodes={2: "host b", 3: "host b", 4: "host c", 5: "host c"})
    assert verdict.lost == [2, 3, 4, 5]
    text = _message(verdict, "averaging", RuntimeError(GLOO))
    assert "ranks 2, 3, 4, 5 were lost while averaging (ranks 2, 3 on host b; ranks 4, 5 " \
           "on host c)" in text
    assert "rank 1 had ended on an error of its own" in text
    assert "TORCH_DISABLE_SHARE" not in text  # not under torchrun's shared store


def test_a_store_that_does_not_answer_names_the_node_keeping_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "host-a")
    monkeypatch.setenv("MASTER_PORT", "29500")
    verdict = _verdict(store_error="DistNetworkError: Connection refused")
    assert verdict.lost == [0, 1]
    text = _message(verdict, "reducing", RuntimeError(GLOO))
    assert "the process group's store at host-a:29500 does not answer" in text
    assert "torchrun's node 0, whose agent keeps it, is lost" in text


def test_the_error_survives_pickling() -> None:
    error = RanksLostError("ranks 2, 3 were lost", lost=[2, 3], what="averaging")
    again = pickle.loads(pickle.dumps(error))
    assert (str(again), again.lost, again.what) == (str(error), [2, 3], "averaging")


def roll_call(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 3 is lost (watched, then its heartbeat stops); rank 2 is alive but busy (it
    beats, never answers); ranks 0 and 1 catch a peer's failure and take the roll call."""
    from overlapkit.nodes import roll_call as roll

    roll.watch()
    # every rank is watched before rank 3 goes silent and the others take the roll
    # call (under load a rank could start late: not yet watched, not lost)
    dist.barrier()
    if rank == 3:
        roll._HEARTBEAT_STOP.set()
        time.sleep(roll.ROLL_CALL_SECONDS + 3)
        return {}
    if rank == 2:
        time.sleep(roll.ROLL_CALL_SECONDS + 3)
        return {}
    started = time.monotonic()
    error = name_lost_ranks(RuntimeError(GLOO), "testing")
    return {"lost": None if error is None else error.lost,
            "message": str(error), "seconds": time.monotonic() - started,
            "host": os.uname().nodename}


def group_after_destroy(rank: int, world_size: int) -> dict[str, Any]:
    """Whether the default process group still exists once destroyed, with the roll
    call's heartbeat beating."""
    import gc
    import weakref

    from overlapkit.nodes import roll_call as roll

    roll.watch()
    group = weakref.ref(dist.distributed_c10d._get_default_group())
    dist.destroy_process_group()
    gc.collect()
    return {"heartbeat alive": any(t.is_alive() for t in roll._HEARTBEATS),
            "group alive": group() is not None}


def test_the_heartbeat_does_not_keep_a_destroyed_process_group() -> None:
    # held by the heartbeat thread, a gloo group outlived destroy_process_group() and
    # was destroyed by that thread or at interpreter exit, where its destructor aborts
    # ("terminate called without an active exception"): a finished torchrun job failed
    for result in run_distributed(group_after_destroy, 2):
        assert not result["group alive"], result  # (the heartbeat beats once a second)


def test_the_roll_call_names_the_silent_rank_only() -> None:
    results = run_distributed(roll_call, 4, timeout=120)
    for result in results[:2]:
        assert result["lost"] == [3]
        assert result["message"].startswith(f"rank 3 (host {result['host']}) was lost "
                                            "while testing")
        assert "where ranks 0, 1, 2 did" in result["message"]
        assert 4.5 < result["seconds"] < 20
