"""One overlapkit error for a collective of an overlapped step that failed because of a
peer: :func:`collective_failure`.

A rank that raises mid-backward and goes on, or hangs, leaves the others waiting in a
gradient bucket's reduction or the parameter exchange of sharded state until the
process group's timeout; gloo then says ``Timed out waiting 8000ms for recv operation
to complete`` and names no rank. Inside a DDP comm hook that error, or the
:class:`~overlapkit.errors.RanksLostError` an inner hook's callback raised, reaches
the caller as a bare ``RuntimeError`` whose text starts with torch's "Got the
following error when running the callback". The bucket steppers catch it where they
wait for the future, turn it into one overlapkit error here, and raise that at the
end of backward (an autograd final callback keeps the exception's type).

After the roll call of :mod:`overlapkit.nodes.lost_ranks` (the ranks gone are named
in a :class:`~overlapkit.errors.RanksLostError`), the failure is an
:class:`~overlapkit.errors.ExchangeFailedError` naming the ranks that are alive but
did not reach the failure (they stopped taking part). Measured (2 gloo ranks, DDP
group timeout 5 s, one rank raising mid-backward and staying alive): plain DDP raises
gloo's timeout at 5.0 s; the overlapped step raises this error at 5.8-6.0 s, sharded
or not (the roll call ends at the silent rank's next heartbeat, at most 1 s later).

.. versionadded:: 0.4
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from overlapkit.errors import ExchangeFailedError, OverlapkitError, RanksLostError
from overlapkit.nodes import lost_ranks
from overlapkit.nodes.lost_ranks import PEER_LOSS_SIGNS, is_peer_failure, name_lost_ranks
from overlapkit.nodes.roll_call import roll_call

__all__ = ["collective_failure", "group_timeout"]

#: how torch's futures report an exception raised in a ``then`` callback
_CALLBACK = re.compile(r"Got the following error when running the callback: (\w+): ")
#: gloo's and NCCL's words for the process-group timeout, in milliseconds
_TIMEOUT_MS = re.compile(r"Timed out waiting (\d+) ?ms|Timeout\(ms\)=(\d+)")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _embedded_lost_ranks(error: BaseException, what: str) -> RanksLostError | None:
    """The :class:`RanksLostError` an inner comm hook's callback raised, whose type the
    future dropped (its message is kept on one line)."""
    for match in _CALLBACK.finditer(str(error)):
        if match.group(1) == RanksLostError.__name__:
            message = str(error)[match.end():].split("\n", 1)[0].strip()
            lost = roll_call().lost if _initialized() else []
            return RanksLostError(message, lost=lost, what=what)
    return None


def _transport_words(error: BaseException) -> str:
    """The transport's own line, without torch's callback prefixes."""
    text = str(error)
    for line in text.splitlines():
        if any(sign in line for sign in PEER_LOSS_SIGNS):
            text = line
            break
    text = _CALLBACK.sub("", text).strip()
    return text if len(text) <= 300 else text[:297] + "..."


def group_timeout(group: Any) -> timedelta | None:
    """The timeout of ``group``'s backend (what ``init_process_group(timeout=...)`` or
    ``new_group(timeout=...)`` set), or None where torch does not tell."""
    import torch

    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
            timeout = backend.options._timeout
        except Exception:  # no such backend, or one without options
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def _timeout_seconds(error: BaseException, group: Any) -> float | None:
    """The process group's timeout: in the transport's words, else the group's."""
    match = _TIMEOUT_MS.search(str(error))
    if match is not None:
        return int(match.group(1) or match.group(2)) / 1000
    timeout = group_timeout(group) if group is not None else None
    return timeout.total_seconds() if timeout is not None else None


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def collective_failure(error: BaseException, what: str,
                       group: Any = None) -> OverlapkitError | None:
    """The overlapkit error for ``error``, a failed collective, or ``None`` when it is
    not a peer's failure (an error of this rank's own, to re-raise as it is).

    - ranks gone (the roll call): :class:`~overlapkit.errors.RanksLostError`;
    - every rank still there: :class:`~overlapkit.errors.ExchangeFailedError`, naming
      the ranks that did not reach the failure and the process group's timeout.

    :param what: what was being done, for the message (``"reducing gradient bucket
        2 (DDP comm hook of overlap_ddp)"``).
    :param group: the process group of the collective, for its timeout where the
        transport's words do not give it.
    """
    if isinstance(error, OverlapkitError):
        return error
    failed: OverlapkitError | None = _embedded_lost_ranks(error, what)
    if failed is None:
        if not is_peer_failure(error):
            return None
        failed = name_lost_ranks(error, what)
    if failed is None:
        message, silent = _stall_message(error, what, group)
        failed = ExchangeFailedError(message, what=what, silent=silent)
    failed.__cause__ = error
    return failed


def _stall_message(error: BaseException, what: str, group: Any) -> tuple[str, list[int]]:
    import torch.distributed as dist

    cause = _transport_words(error)
    timeout = _timeout_seconds(error, group)
    rank = dist.get_rank() if _initialized() else 0
    verdict = roll_call() if _initialized() else None
    silent = sorted(verdict.beating - verdict.answered) if verdict is not None else []
    left = sorted(verdict.left) if verdict is not None else []
    if "time" in cause.lower():
        waited = ("this rank gave up after the process group's timeout"
                  + (f" ({timeout:g} s)" if timeout else ""))
    else:
        waited = "this rank's connection to it was closed"
    if silent:
        are = "is" if len(silent) == 1 else "are"
        why = (f"{_ranks(silent)} {are} alive (beating a heartbeat) but did not take part "
               "in it: stopped before it (an error raised during backward that the loop "
               f"went on from) or hanging; {waited}")
        culprit = _ranks(silent)
    elif left:
        had = "has" if len(left) == 1 else "have"
        why = f"{_ranks(left)} {had} ended on an error of its own (see the output)"
        culprit = _ranks(left)
    else:
        why = ("every rank reported a failure of it (none stopped without one), so a rank "
               "came late to it: stalled, or went on after an error raised before it; "
               f"{waited}")
        culprit = "the late rank"
    checkpoint = lost_ranks.last_complete_checkpoint
    resume = (f"from the last complete checkpoint ({checkpoint})" if checkpoint is not None
              else "(this run has not completed or resumed from a checkpoint yet)")
    message = (f"{what} failed on rank {rank}: {why}. The transport said: {cause}. The "
               "process group cannot be used after this (its later collectives fail "
               f"too). Find out why {culprit} stopped (its own error in its output; for a "
               "rank that hangs, py-spy dump --pid PID), fix it, and restart the job "
               f"{resume}.")
    return message, silent
