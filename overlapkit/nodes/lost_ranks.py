"""Which ranks a failed collective lost: one clear error instead of the transport's.

When a node is lost — killed, powered off, cut off — the surviving ranks' next
collective fails with the transport's own error, which names no rank: gloo says
``Read error [10.0.0.2]:41234: Connection reset by peer`` at once for a node whose
processes died (their sockets are closed), and ``Timed out waiting 1800000ms for recv
operation to complete`` after the process group's timeout for one that hangs.

overlapkit's own collectives — its DDP comm hooks, model averaging, checkpoint save
and load — catch such a failure (:func:`lost_ranks_named`, :func:`reduced_tensor`) and
take a **roll call** through the process group's store
(:mod:`overlapkit.nodes.roll_call`): every rank that answers, beats its heartbeat or
left a note at exit within a few seconds is there; the others are lost, each with the
node it was on.

The survivors then raise :class:`~overlapkit.errors.RanksLostError` naming the lost
ranks and their node, with the transport's error as its cause, and saying what to do
next. A failure where every rank answers is not a loss: the original error is
re-raised unchanged. A store that does not answer means the node keeping it is lost
(torchrun's node 0, or rank 0 where the workers keep it), and the message says so.

Measured on loopback (two torchrun agents of two ranks, gloo, one agent and its
workers killed with SIGKILL): the survivors' collective fails within milliseconds and
they raise after the roll call, 5 s later; ``docs/benchmarks.md`` has the figures.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from overlapkit.errors import RanksLostError
from overlapkit.nodes.roll_call import (
    ROLL_CALL_SECONDS,
    Verdict,
    agent_keeps_store,
    first_line,
    roll_call,
    watch,
)

__all__ = [
    "PEER_LOSS_SIGNS",
    "is_peer_failure",
    "lost_ranks_named",
    "name_lost_ranks",
    "note_complete_checkpoint",
    "reduced_tensor",
    "watch",
]

#: substrings of the errors torch's transports raise when a peer is gone or hangs
PEER_LOSS_SIGNS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Timed out waiting",  # gloo, a peer that hangs: after the process group's timeout
    "Application timeout caused pair closure",  # gloo, the same (a later op on the pair)
    "Socket Timeout",
    "NCCL communicator was aborted",
    "remote process exited",
    "Watchdog caught collective operation timeout",
)


#: the last checkpoint this process saved or resumed from with overlapkit.checkpoint
#: (its path), for the message: ``None`` until one is
last_complete_checkpoint: str | None = None


def note_complete_checkpoint(path: object) -> None:
    """Record that the checkpoint at ``path`` is complete (a save returned, or a run
    resumed from it), so a later loss can say it is intact — and, before any, that
    there is none to resume from."""
    global last_complete_checkpoint
    last_complete_checkpoint = str(path)


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, its causes and contexts, and the per-rank failures DCP's
    ``CheckpointException`` carries."""
    stack: list[Any] = [error]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, tuple) and item:  # DCP: (exception, traceback summary)
            item = item[0]
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        stack += [item.__cause__, item.__context__]
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            stack += list(failures.values())


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (or anything in its chain) is a transport's error for a peer
    that is gone or hangs (:data:`PEER_LOSS_SIGNS`)."""
    return any(sign in str(item) for item in _chain(error) for sign in PEER_LOSS_SIGNS)


def _transport_error(error: BaseException) -> str:
    """The transport's own words: the innermost error of the chain that shows a sign."""
    for item in reversed(list(_chain(error))):
        text = str(item)
        for sign in PEER_LOSS_SIGNS:
            if sign in text:
                line = next(line for line in text.splitlines() if sign in line).strip()
                return line if len(line) <= 300 else line[:297] + "..."
    return first_line(error)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _saved(what: str) -> str:
    """What is saved: the last complete checkpoint, or that there is none yet."""
    if last_complete_checkpoint is not None:
        return (" Their work since the last complete checkpoint is lost; that checkpoint "
                f"({last_complete_checkpoint}) is intact (a save is complete only once every "
                "rank has written its part).")
    writing = (" The checkpoint being written is not complete and will not be taken."
               if what.startswith("saving") else "")
    return (" This run has not completed or resumed from a checkpoint "
            f"(overlapkit.checkpoint) yet, so none is there to resume from.{writing}")


def _restart_advice() -> str:
    first = "Resume from it" if last_complete_checkpoint is not None else "Start again"
    advice = (f" {first}: restart the job, or launch with torchrun --max-restarts N, "
              "which restarts it once the lost node's torchrun is started again "
              "(docs/nodes.rst).")
    if agent_keeps_store() and os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        advice += (" On torch 2.13 a restarted node cannot rejoin while torchrun shares its "
                   "store with the workers (the rendezvous waits for keys no node writes "
                   "until its join timeout, pytorch #135712): set "
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node.")
    return advice


def _message(verdict: Verdict, what: str, error: BaseException) -> str:
    lost = verdict.lost
    cause = _transport_error(error)
    saved = _saved(what)
    if verdict.store_error is not None:
        keeper = ("torchrun's node 0, whose agent keeps it" if agent_keeps_store()
                  else "rank 0, whose process keeps it")
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        were = "was" if len(lost) == 1 else "were"
        return (f"{_ranks(lost)} {were} lost while {what}: this rank's collective failed "
                f"({cause}), "
                f"and the process group's store at {where} does not answer "
                f"({verdict.store_error}): {keeper}, is lost, and other ranks may be too "
                f"(without the store this rank cannot tell which).{saved}"
                f"{_restart_advice()}")
    by_node: dict[str, list[int]] = {}
    for rank in lost:
        by_node.setdefault(verdict.nodes.get(rank, "node unknown"), []).append(rank)
    were = "was" if len(lost) == 1 else "were"
    if len(by_node) == 1:
        who = f"{_ranks(lost)} ({next(iter(by_node))}) {were} lost while {what}"
    else:
        where = "; ".join(f"{_ranks(ranks)} on {node}" for node, ranks in by_node.items())
        who = f"{_ranks(lost)} {were} lost while {what} ({where})"
    own = "its" if len(verdict.left) == 1 else "their"
    left = (f" {_ranks(sorted(verdict.left))} had ended on an error of {own} own "
            "(see the output)." if verdict.left else "")
    if verdict.cut_short:
        left += (f" The store stopped answering after {verdict.seconds:.1f} s of the roll "
                 "call: the ranks not seen by then are named.")
    they = "it" if len(lost) == 1 else "they"
    return (f"{who}: this rank's collective failed ({cause}), and {they} neither answered "
            f"a roll call nor beat a heartbeat within {ROLL_CALL_SECONDS:.0f} s, where "
            f"{_ranks(sorted(verdict.alive))} did.{left}{saved}{_restart_advice()}")


def name_lost_ranks(error: BaseException, what: str) -> RanksLostError | None:
    """A :class:`~overlapkit.errors.RanksLostError` for ``error`` when it is a peer's
    failure and ranks are lost (after a roll call, once per process), else ``None``.

    :param what: what was being done, for the message (``"saving the checkpoint to
        ckpt"``).
    """
    if isinstance(error, RanksLostError) or not is_peer_failure(error):
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    verdict = roll_call()
    if not verdict.lost:
        return None
    return RanksLostError(_message(verdict, what, error), lost=verdict.lost, what=what)


@contextmanager
def lost_ranks_named(what: str) -> Iterator[None]:
    """Run the body; a collective failure in it that lost ranks becomes a
    :class:`~overlapkit.errors.RanksLostError` naming them (any other error, or a
    failure where every rank answers, passes unchanged)."""
    watch()
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as error:
        named = name_lost_ranks(error, what)
        if named is None:
            raise
        raise named from error


def reduced_tensor(future: Any) -> Any:
    """The reduced tensor of a comm hook's allreduce future (``future.value()[0]``), or
    a :class:`~overlapkit.errors.RanksLostError` if the allreduce failed because ranks
    were lost. For ``work.get_future().then(reduced_tensor)``."""
    try:
        return future.value()[0]
    except Exception as error:
        named = name_lost_ranks(error, "reducing a gradient bucket (DDP comm hook)")
        if named is None:
            raise
        raise named from error
