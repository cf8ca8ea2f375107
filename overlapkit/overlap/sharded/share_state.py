"""``optimizer.state`` of a sharded optimizer: this rank's share, which a read of another
rank's parameter leaves as it is (:class:`ShareOfState`).

The real optimizer's ``state`` is a ``defaultdict``: reading ``state[p]`` for a
parameter without state stores an empty entry for it. On a plain optimizer that is
harmless (every parameter gets its state at the first step anyway); on a sharded one
``p`` may be another rank's, whose state this rank never holds, so a loop reading the
state of every parameter (``opt.state[p].get("step")`` for a log) left an empty entry
per parameter another rank owns, and:

- between ``backward()`` and ``step()`` the window's check read the grown ``state`` as
  a reset and refused the ``step()`` on every rank that read one (measured: 2 gloo ranks,
  AdamW, ``"optimizer.state (5 entries -> 9, a reset)"`` at the first step, where the
  plain loop reads without a word); reading one parameter's only, on the ranks not
  owning it only;
- ``len(opt.state)`` and ``p in opt.state`` answered for parameters this rank does not
  hold state of, and torch's ``set_optimizer_state_dict`` / ``get_optimizer_state_dict``
  found ``state`` non-empty on that rank alone before the first step, skipped its
  initialising step there while the other ranks took it, and they waited for that
  rank's part of the parameter exchange until the group's timeout.

So reading another rank's parameter gives an empty dict that is not stored (its state
is its owner's), whose entries, read, raise :class:`OwnedElsewhereError` naming the owner
(``opt.state[p]["exp_avg"].zero_()`` on every rank raised a bare ``KeyError: 'exp_avg'``
on the ranks not owning ``p``), and ``del opt.state[p]`` there deletes nothing (it raised a
bare ``KeyError`` printing the parameter's values, where the owner's ``del`` resets the
state, as a plain optimizer's on every rank); everything else — this rank's
parameters, writes (``state[p] = ...``), deletes, ``clear()``, iteration — is the real
optimizer's ``state``, read live (it is replaced by ``load_state_dict`` and by
``opt.state = ...``).

.. versionadded:: 0.4
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.core.watched_reads import WatchedState
from overlapkit.overlap.sharded.ownership import Ownership

__all__ = ["OwnedElsewhereError", "ShareOfState"]


class OwnedElsewhereError(ConfigurationError, KeyError):
    """A state entry of a parameter another rank owns was read (``opt.state[p]["exp_avg"]``
    on a rank that does not own ``p``): a ``ConfigurationError`` and a ``KeyError``
    (what a missing entry raises, so ``except KeyError`` still catches it)."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class _OwnersState(dict[str, Any]):
    """The (empty) state this rank shows for a parameter another rank owns: reading an
    entry names the owner, where a bare ``KeyError: 'exp_avg'`` named nothing."""

    def __init__(self, owner: int, rank: int) -> None:
        super().__init__()
        self._owner, self._rank = owner, rank

    def __missing__(self, key: str) -> Any:
        raise OwnedElsewhereError(
            f"optimizer.state[p][{key!r}] on rank {self._rank}: the optimizer state is "
            f"sharded, and rank {self._owner} owns p, steps it and keeps its state; this "
            "rank holds none of it. Read or change a parameter's state on its owner (if "
            "p in optimizer.state), or go over this rank's share (for p, s in "
            "optimizer.state.items()) on every rank. To reset it, del optimizer.state[p] "
            "on every rank (a no-op where another rank owns p).")


class ShareOfState(MutableMapping[Any, Any]):
    """The ``state`` a :class:`~overlapkit.overlap.sharded.optimizer.
    ShardedOverlapOptimizer` shows (see the module docstring).

    :param optimizer: the real optimizer, whose ``state`` is read live.
    :param ownership: returns the current ownership (it follows ``add_param_group`` and
        reordered ``param_groups``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 ownership: Callable[[], Ownership]) -> None:
        self._optimizer = optimizer
        self._ownership = ownership

    @property
    def real(self) -> Any:
        """The real optimizer's ``state`` (a ``defaultdict(dict)``)."""
        return self._optimizer.state

    def _owner(self, key: Any) -> int | None:
        """The rank owning ``key`` when it is a parameter of the optimizer another rank
        owns, else None."""
        if not isinstance(key, torch.Tensor):
            return None
        ownership = self._ownership()
        owner = ownership.owner_of(key)
        return None if owner is None or owner == ownership.rank else owner

    def _dict(self) -> Any:
        """The real ``state``'s dict itself: while the first window is learnt the real
        ``state`` is a :class:`~overlapkit.overlap.core.watched_reads.WatchedState`,
        whose ``in`` reads the entry (storing an empty one); the read is noted there
        all the same, on every rank alike."""
        state = self.real
        if isinstance(state, WatchedState):
            return state._note()
        return state

    def __getitem__(self, key: Any) -> Any:
        owner = self._owner(key)
        if owner is None:
            return self.real[key]  # a defaultdict's read, as on a plain optimizer
        state = self._dict()
        # another rank's parameter: its state is its owner's; nothing stored
        return state.get(key) or _OwnersState(owner, self._ownership().rank)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.real[key] = value

    def __delitem__(self, key: Any) -> None:
        """Another rank's parameter without an entry here: nothing to delete (its owner's
        ``del`` resets its state; a plain optimizer's ``del`` works on every rank)."""
        state = self._dict()
        if key in state or self._owner(key) is None:
            del state[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.real)

    def __len__(self) -> int:
        return len(self.real)

    def __contains__(self, key: object) -> bool:
        return key in self._dict()

    def get(self, key: Any, default: Any = None) -> Any:
        return self._dict().get(key, default)

    def copy(self) -> Any:
        """A shallow copy of the real ``state`` (as ``defaultdict.copy``)."""
        return self.real.copy()

    def __copy__(self) -> Any:
        return copy.copy(self.real)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.real, memo)

    def __reduce__(self) -> tuple[Any, ...]:
        return (copy.copy, (self.real,))

    def __eq__(self, other: object) -> bool:
        return self.real == (other.real if isinstance(other, ShareOfState) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.real)
