"""A plugin averager's own collectives watched for another rank's failure note.

:mod:`overlapkit.local_sgd.failures` tells the ranks waiting in overlapkit's averaging
collectives that an averager raised on another rank. An averager of a plugin's that
calls ``dist.all_reduce`` itself (a synchronous call, blocked in gloo's C++ receive)
was not watched: at 968cf42, with 2 gloo ranks, rank 1's averager raising before its
``all_reduce`` left rank 0 waiting in it until the process group's timeout (30 min by
default), the note in the store unread. Nothing on another thread can unblock that
receive (gloo's ``abort()`` does not; destroying the group on the failing rank closes
no socket while the averager and the DDP model still hold the group).

So while an averager runs inside :func:`~overlapkit.local_sgd.failures.averaging_failures`
(:func:`begin` to :func:`end`), the blocking collectives of ``torch.distributed`` called on that
thread (:data:`WATCHED`) are started with ``async_op=True`` and waited for with
:func:`~overlapkit.local_sgd.failures.wait_watching`: the same collective, the same
result, and a rank whose peer left a note raises ``ExchangeFailedError`` naming it
within ``POLL_SECONDS``. A call that asks for ``async_op=True`` itself is left as it
is (its ``wait()`` is the averager's), and so is every call outside an averaging.

The functions are replaced in ``torch.distributed`` once, when the first
``PostLocalSGDOptimizer`` is built (:func:`install`), as
:mod:`overlapkit.overlap.rules.late_clipping` replaces torch's clipping: a plugin that
bound ``from torch.distributed import all_reduce`` before that keeps torch's own
(documented in ``docs/post_local_sgd.rst``). Cost: per ``step()``, a thread-local flag
set and reset (measured below 1 us, 2-core VM); per collective call anywhere, one
Python call and that flag read (0.7 us).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["WATCHED", "begin", "end", "install"]

#: the blocking collectives of ``torch.distributed`` watched during an averaging
WATCHED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
           "reduce_scatter_tensor", "reduce", "barrier", "all_to_all_single")

_LOCAL = threading.local()
_INSTALLED: list[bool] = [False]


def begin() -> bool:
    """Watch this thread's blocking collectives (see the module) until :func:`end`;
    returns what :func:`end` restores (an averaging within another)."""
    before = getattr(_LOCAL, "on", False)
    _LOCAL.on = True
    return before


def end(before: bool) -> None:
    """Stop what :func:`begin` started."""
    _LOCAL.on = before


def _watched(collective: Callable[..., Any]) -> Callable[..., Any]:
    position = list(inspect.signature(collective).parameters).index("async_op")

    @functools.wraps(collective)
    def call(*args: Any, **kwargs: Any) -> Any:
        if (not getattr(_LOCAL, "on", False) or len(args) > position
                or kwargs.get("async_op")):
            return collective(*args, **kwargs)
        from overlapkit.local_sgd.failures import wait_watching  # it imports this

        kwargs["async_op"] = True
        work = collective(*args, **kwargs)
        if work is not None:  # None: this rank is not in the group
            wait_watching(work)
        return None

    call.__wrapped_by_overlapkit__ = collective  # type: ignore[attr-defined]
    return call


def install() -> None:
    """Replace :data:`WATCHED` in ``torch.distributed`` by their watched versions, once."""
    if _INSTALLED[0] or not dist.is_available():
        return
    _INSTALLED[0] = True
    for name in WATCHED:
        collective = getattr(dist, name, None)
        if collective is None or hasattr(collective, "__wrapped_by_overlapkit__"):
            continue
        try:
            watched = _watched(collective)
        except (TypeError, ValueError):  # no async_op parameter in this torch
            continue
        setattr(dist, name, watched)
