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
within ``POLL_SECONDS``. A call that asks for ``async_op=True`` itself (by keyword or
position) gets a :class:`WatchedWork`: torch's ``Work``, whose ``wait()`` watches the
same way, wherever the averager waits for it (at be7423f it was left as it was: rank 0
waited in the averager's ``work.wait()`` until the process group's timeout). Every
call outside an averaging is left as it is.

The functions are replaced in ``torch.distributed`` once, when the first
``PostLocalSGDOptimizer`` is built (:func:`install`), as
:mod:`overlapkit.overlap.rules.late_clipping` replaces torch's clipping: a plugin that
bound ``from torch.distributed import all_reduce`` before that keeps torch's own
(documented in ``docs/post_local_sgd.rst``). Cost: per ``step()``, a thread-local flag
set and reset (measured below 1 us, 2-core VM); per collective call anywhere, one
Python call and that flag read (0.7 us).
"""

from __future__ import annotations

import datetime
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["WATCHED", "WatchedWork", "begin", "end", "install"]

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


class WatchedWork(dist.Work):
    """The ``Work`` of a collective an averager started with ``async_op=True``: its
    ``wait()`` (without a timeout) is :func:`~overlapkit.local_sgd.failures.wait_watching`;
    everything else is the collective's own ``Work``, which :attr:`work` holds. A
    subclass of ``dist.Work``, so ``isinstance`` checks hold."""

    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        #: the collective's own ``Work``
        self.work = work

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """Wait as torch's ``wait()``, raising ``ExchangeFailedError`` if another rank's
        averager raised meanwhile; a ``timeout`` given is torch's own wait."""
        if timeout:
            return bool(self.work.wait(timeout))
        from overlapkit.local_sgd.failures import wait_watching  # it imports this

        wait_watching(self.work)
        return True

    # torch's own, delegated to the collective's Work
    def get_future(self) -> Any:
        return self.work.get_future()

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def is_success(self) -> bool:
        return bool(self.work.is_success())

    def exception(self) -> Any:
        return self.work.exception()

    def source_rank(self) -> int:
        return int(self.work.source_rank())

    def result(self) -> list[Any]:
        return list(self.work.result())

    def synchronize(self) -> None:
        self.work.synchronize()

    def __getattr__(self, name: str) -> Any:  # what a later torch adds
        return getattr(self.__dict__["work"], name)


def _watched(collective: Callable[..., Any]) -> Callable[..., Any]:
    position = list(inspect.signature(collective).parameters).index("async_op")

    @functools.wraps(collective)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not getattr(_LOCAL, "on", False):
            return collective(*args, **kwargs)
        from overlapkit.local_sgd.failures import wait_watching  # it imports this

        if len(args) > position:
            asked = bool(args[position])
            args = (*args[:position], True, *args[position + 1:])
        else:
            asked = bool(kwargs.get("async_op"))
            kwargs["async_op"] = True
        work = collective(*args, **kwargs)
        if work is None:  # this rank is not in the group
            return None
        if asked:  # the averager waits for it: its wait() watched
            return WatchedWork(work)
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
