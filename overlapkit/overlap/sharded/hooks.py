"""The hooks a sharded optimizer takes: step hooks refused, state-dict hooks handed the
sharded optimizer itself (:class:`ShardedHooks`).

torch calls an optimizer's state-dict hooks with the optimizer they were registered on
(``hook(self, state_dict)``). A wrapper registering them on the real optimizer inside
handed them that one instead, whose ``state`` is a ``defaultdict`` of this rank's share
alone, so a hook doing what a plain optimizer's hook does went wrong (measured, 2 gloo
ranks, AdamW):

- a post-hook logging every parameter's ``optimizer.state[p].get("step")`` stored an
  empty entry for each parameter another rank owns (``len(state)`` 9 on both ranks, 5
  and 4 owned); done before the first step on the rank gathering only (its
  ``consolidate_state_dict`` + ``state_dict()``), torch's ``set_optimizer_state_dict``
  then skipped its initialising step on that rank alone, and the other waited for its
  exchange until the group's timeout (6.0 s at a 5 s timeout, ``ExchangeFailedError``,
  the process group unusable after);
- a load post-hook reading ``optimizer.state[p]["step"]`` of every parameter raised a
  bare ``KeyError: 'step'`` on every rank (having stored an empty entry first).

Handed the sharded optimizer, a hook reads its :class:`~overlapkit.overlap.sharded.
share_state.ShareOfState` (nothing stored; an entry of another rank's parameter raises
``OwnedElsewhereError`` naming the owner), and ``optimizer is opt`` holds, as with a
plain optimizer.

.. versionadded:: 0.4
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from overlapkit.overlap.core.step_hooks import sharded_step_hook_refusal

__all__ = ["ShardedHooks", "handed_to"]


def handed_to(optimizer: torch.optim.Optimizer, hook: Callable[..., Any]
              ) -> Callable[..., Any]:
    """``hook``, called with ``optimizer`` in place of the optimizer that calls it (the
    real one inside). ``optimizer`` is held weakly: the real optimizer keeps the hook,
    and a cycle back to the wrapper would keep it alive after the loop drops it."""
    held = weakref.ref(optimizer)

    @functools.wraps(hook)
    def on_the_wrapper(caller: torch.optim.Optimizer, *args: Any) -> Any:
        return hook(held() or caller, *args)

    return on_the_wrapper


class ShardedHooks(torch.optim.Optimizer):
    """The hook registrations of :class:`~overlapkit.overlap.sharded.optimizer.
    ShardedOverlapOptimizer` (a mix-in over :class:`~overlapkit.OptimizerWrapper`):
    step hooks refused (:func:`~overlapkit.overlap.core.step_hooks.
    sharded_step_hook_refusal`), state-dict hooks registered on the real optimizer,
    handed this one (see the module docstring)."""

    def register_step_pre_hook(self, hook: Any) -> Any:
        """Refused: see :func:`~overlapkit.overlap.core.step_hooks.sharded_step_hook_refusal`."""
        raise sharded_step_hook_refusal("register_step_pre_hook")

    def register_step_post_hook(self, hook: Any) -> Any:
        """Refused: see :func:`~overlapkit.overlap.core.step_hooks.sharded_step_hook_refusal`."""
        raise sharded_step_hook_refusal("register_step_post_hook")

    def register_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        """``hook(optimizer)`` before each ``state_dict()`` (``local_state_dict()``
        too), handed this optimizer."""
        return super().register_state_dict_pre_hook(handed_to(self, hook), prepend)

    def register_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        """``hook(optimizer, state_dict)`` after each ``state_dict()`` (the whole,
        gathered one on rank ``to``) and ``local_state_dict()``, handed this optimizer."""
        return super().register_state_dict_post_hook(handed_to(self, hook), prepend)

    def register_load_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        """``hook(optimizer, state_dict)`` on the whole dict given to
        ``load_state_dict``, handed this optimizer."""
        return super().register_load_state_dict_pre_hook(handed_to(self, hook), prepend)

    def register_load_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        """``hook(optimizer)`` after each ``load_state_dict``, handed this optimizer."""
        return super().register_load_state_dict_post_hook(handed_to(self, hook), prepend)
