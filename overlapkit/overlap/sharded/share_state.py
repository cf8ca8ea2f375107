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
is its owner's); everything else — this rank's parameters, writes (``state[p] = ...``),
deletes, ``clear()``, iteration — is the real optimizer's ``state``, read live (it is
replaced by ``load_state_dict`` and by ``opt.state = ...``).

.. versionadded:: 0.4
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch

from overlapkit.overlap.core.watched_reads import WatchedState
from overlapkit.overlap.sharded.ownership import Ownership

__all__ = ["ShareOfState"]


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

    def _others(self, key: Any) -> bool:
        """Whether ``key`` is a parameter of the optimizer that another rank owns."""
        if not isinstance(key, torch.Tensor):
            return False
        ownership = self._ownership()
        owner = ownership.owner_of(key)
        return owner is not None and owner != ownership.rank

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
        if not self._others(key):
            return self.real[key]  # a defaultdict's read, as on a plain optimizer
        state = self._dict()
        # another rank's parameter: its state is its owner's; nothing stored
        return state.get(key, {})

    def __setitem__(self, key: Any, value: Any) -> None:
        self.real[key] = value

    def __delitem__(self, key: Any) -> None:
        del self.real[key]

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
