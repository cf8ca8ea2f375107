"""The comm hook's state under ``overlap_ddp(..., shard_optimizer_state=True)``.

A stateful comm hook chosen by name (PowerSGD: warm-up counter, error feedback,
warm-start matrices, random generator) keeps state of each rank's own. Without sharding
``state_dict()`` holds this rank's under ``"comm_hook"``
(:mod:`overlapkit.overlap.ddp.hook_state`); with sharding, up to 258114a nothing of it
reached any state dict, and a resumed run started the hook afresh, silently off the
uninterrupted one. Now:

- :meth:`~ShardedCommHookState.local_state_dict` (one file per rank) holds this rank's
  hook state under ``"comm_hook"``, and :meth:`~ShardedCommHookState.load_state_dict`
  of it puts it back (checked first: a refusal loads nothing): bitwise the
  uninterrupted run;
- the whole state dict (``state_dict()``, gathered on one rank) and
  ``overlapkit.checkpoint.save`` cannot hold every rank's: each warns once that it
  leaves the hook's state out, naming ``local_state_dict()``. At world size 1 the
  state dict is this rank's and holds it.

Run at saving and loading only, never per step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from overlapkit.overlap.ddp.hook_state import KEY, hook_state_loader, saved_hook_state

__all__ = ["ShardedCommHookState"]


class ShardedCommHookState:
    """Mixed into :class:`~overlapkit.overlap.sharded.optimizer.ShardedOverlapOptimizer`,
    whose state-dict methods call it (see the module)."""

    #: the name the comm hook was chosen by (``comm_hook=``), for messages
    _hook_name = "allreduce"
    _steps: Any
    _ownership: Any

    @property
    def comm_hook_state(self) -> Any:
        """The state of the comm hook the model reduces with (a ``PowerSGDState``, a
        process group), as ``build_comm_hook(name)`` returned it."""
        return getattr(self._steps, "inner_state", None)

    def _hook_warned(self) -> list[bool]:
        """Warned of, once each: an unknown state, the whole state dict, checkpoint.save."""
        flags: list[bool] | None = self.__dict__.get("_hook_state_warned")
        if flags is None:
            flags = self.__dict__["_hook_state_warned"] = [False, False, False]
        return flags

    def _saved_hook_state(self) -> dict[str, Any] | None:
        warned = self._hook_warned()
        return saved_hook_state(self.comm_hook_state, self._hook_name, warned)

    def _left_out(self, where: str, flag: int) -> str | None:
        warned = self._hook_warned()
        if warned[flag] or saved_hook_state(
                self.comm_hook_state, self._hook_name, [True]) is None:
            return None
        warned[flag] = True
        return (f"{where} does not hold the state of the comm hook {self._hook_name!r}, "
                "each rank's own (PowerSGD's error feedback), which a state dict gathered "
                "on one rank cannot hold: a run resumed from it alone starts that hook "
                "afresh. Save optimizer.local_state_dict() on every rank as well "
                "(torch.save(opt.local_state_dict(), f'optim-{rank}.pt')) and load it "
                "with optimizer.load_state_dict() after the whole one.")

    def _with_local_hook_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``local_state_dict()``'s ``state_dict`` with this rank's hook state in it."""
        saved = self._saved_hook_state()
        if saved is not None:
            state_dict[KEY] = saved
        return state_dict

    def _with_whole_hook_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict()``'s ``state_dict``: with the hook state at world size 1 (this
        rank's), else as it is, warned of once."""
        if self._ownership.world_size == 1:
            return self._with_local_hook_state(state_dict)
        if (warning := self._left_out("optimizer.state_dict() (gathered)", 1)):
            warnings.warn(warning, UserWarning, stacklevel=3)
        return state_dict

    def left_out_of_checkpoints(self) -> str | None:
        """What ``overlapkit.checkpoint.save`` warns of, once (see the module)."""
        return self._left_out("overlapkit.checkpoint.save()", 2)

    def _without_hook_state(self, state_dict: Any) -> tuple[Any, Callable[[], None]]:
        """``state_dict`` without its ``"comm_hook"`` entry, and what loads that entry
        into the hook once the optimizer has loaded the rest.

        :raises CheckpointError: the entry does not fit this hook; nothing is loaded."""
        saved = None
        if isinstance(state_dict, Mapping) and KEY in state_dict:
            saved = state_dict[KEY]
            state_dict = {key: value for key, value in state_dict.items() if key != KEY}
        return state_dict, hook_state_loader(self.comm_hook_state, self._hook_name, saved)
