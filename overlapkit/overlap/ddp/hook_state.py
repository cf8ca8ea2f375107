"""The state of the comm hook ``overlap_ddp(..., comm_hook=NAME)`` reduces with, saved in
the optimizer's ``state_dict()`` under ``"comm_hook"`` and restored by its
``load_state_dict()``.

Under plain DDP a user holds the hook's state (``register_comm_hook(state, hook)``) and
saves it as torch documents (``torch.save`` of a ``PowerSGDState``). Under
``overlap_ddp`` the hook is built by name inside the set-up, so nothing of it reached a
checkpoint: at 968cf42 a run resumed with PowerSGD (chosen through a plugin's
``overlapkit_register_comm_hooks``) started its hook afresh (warm-up counter, error
feedback, warm-start matrices and random generator), silently off the uninterrupted run.

What is saved, by the kind of state (:func:`saved_hook_state`):

- ``None`` or a process group (the stateless hooks: ``allreduce``, ``fp16_compress``):
  nothing;
- a state with ``state_dict()`` and ``load_state_dict()`` (``post_local_sgd``'s, a
  plugin's): what its ``state_dict()`` returns;
- torch's ``PowerSGDState``: its counters, error feedback, warm-start matrices and its
  random generator's state, as tensors and numbers (``torch.load`` with
  ``weights_only=True`` reads them), and its settings, checked at load;
- anything else: nothing, with one warning per optimizer naming the hook and saying
  what its state needs.

Run at ``state_dict()`` / ``load_state_dict()`` only, never per step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from overlapkit.errors import CheckpointError
from overlapkit.overlap.facade import OverlappedOptimizerFacade

__all__ = ["KEY", "CommHookStateFacade", "hook_state_loader", "saved_hook_state"]

#: the optimizer state dict's key for the comm hook's state
KEY = "comm_hook"

_POWER_SGD = "torch PowerSGDState"
#: PowerSGD's settings: a resumed hook with others would not continue the saved run
_SETTINGS = ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
             "orthogonalization_epsilon", "use_error_feedback", "warm_start",
             "batch_tensors_with_same_shape")
_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression",
             "compression_stats_logging_frequency", "next_stats_report")
_TENSORS = ("error_dict", "p_memory_dict", "q_memory_dict")


def _stateless(state: Any) -> bool:
    return state is None or isinstance(state, dist.ProcessGroup)


def _has_state_dict(state: Any) -> bool:
    return callable(getattr(state, "state_dict", None)) and callable(
        getattr(state, "load_state_dict", None))


def _rank() -> int | None:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def saved_hook_state(state: Any, name: str, warned: list[bool]) -> dict[str, Any] | None:
    """What ``state_dict()`` keeps of the comm hook ``name``'s ``state`` (see the
    module's docstring), or None. ``warned`` (one flag, the optimizer's) keeps the
    warning for an unknown state to one."""
    if _stateless(state):
        return None
    if isinstance(state, PowerSGDState):
        return _power_sgd(state)
    if _has_state_dict(state):
        saved = state.state_dict()
        if not isinstance(saved, Mapping):
            raise CheckpointError(
                f"the comm hook {name!r}'s state {type(state).__name__}.state_dict() "
                f"returned a {type(saved).__name__}, not a dict, so the optimizer's "
                "state_dict() could not be resumed from; fix the hook's state (or its "
                "plugin). Nothing was saved.")
        return dict(saved)
    if not warned[0]:
        warned[0] = True
        warnings.warn(
            f"optimizer.state_dict() does not hold the state of the comm hook {name!r} "
            f"(a {type(state).__module__}.{type(state).__qualname__}, which has no "
            "state_dict() / load_state_dict()): a run resumed from it starts that hook "
            "afresh. If the hook keeps state across backwards, give its state those two "
            "methods (its plugin's builder returns the state), and overlapkit saves and "
            "restores it under 'comm_hook'.", UserWarning, stacklevel=3)
    return None


def _power_sgd(state: PowerSGDState) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = state.rng.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)
    saved: dict[str, Any] = {"kind": _POWER_SGD, "rank": _rank(),
                             "rng": {"name": str(name),
                                     "keys": torch.from_numpy(keys.astype(np.int64)),
                                     "pos": int(pos), "has_gauss": int(has_gauss),
                                     "cached_gaussian": float(cached)}}
    for slot in _SETTINGS + _COUNTERS:
        saved[slot] = getattr(state, slot)
    for slot in _TENSORS:
        saved[slot] = dict(getattr(state, slot))
    return saved


def hook_state_loader(state: Any, name: str, saved: Any) -> Callable[[], None]:
    """Check the ``"comm_hook"`` entry ``saved`` (None: absent) against the live hook
    ``state`` and return what puts it in; called before the optimizer's own load,
    whose refusal then leaves the hook as it was.

    :raises CheckpointError: the entry is not for this kind of hook, or was saved with
        other settings; nothing is loaded.
    """
    if saved is None or _stateless(state):
        return lambda: None
    if not isinstance(saved, Mapping):
        raise CheckpointError(
            f"the state dict's 'comm_hook' entry is a {type(saved).__name__}, not a "
            "dict; load what this optimizer's state_dict() returned. Nothing was loaded.")
    if isinstance(state, PowerSGDState):
        return _power_sgd_loader(state, name, saved)
    if saved.get("kind") == _POWER_SGD:
        raise CheckpointError(
            f"the state dict holds a PowerSGD comm hook's state, but this optimizer "
            f"reduces with the comm hook {name!r} ({type(state).__name__}); resume with "
            "the comm hook it was saved with. Nothing was loaded.")
    if _has_state_dict(state):
        return lambda: state.load_state_dict(saved)
    return lambda: None


def _power_sgd_loader(state: PowerSGDState, name: str,
                      saved: Mapping[str, Any]) -> Callable[[], None]:
    if saved.get("kind") != _POWER_SGD:
        raise CheckpointError(
            f"the state dict's 'comm_hook' entry was not saved by a PowerSGD comm hook "
            f"(keys {sorted(map(str, saved))}), and this optimizer reduces with "
            f"{name!r}, a PowerSGD one; resume with the comm hook it was saved with. "
            "Nothing was loaded.")
    other = {slot: (saved.get(slot), getattr(state, slot)) for slot in _SETTINGS
             if saved.get(slot) != getattr(state, slot)}
    if other:
        described = ", ".join(f"{slot} {was!r} saved, {now!r} now"
                              for slot, (was, now) in other.items())
        raise CheckpointError(
            f"the comm hook {name!r}'s state was saved with other PowerSGD settings "
            f"({described}), so the resumed run would not continue the saved one; pass "
            "the saved settings as comm_hook_options. Nothing was loaded.")
    rank = _rank()
    if saved.get("rank") is not None and rank is not None and saved["rank"] != rank:
        warnings.warn(
            f"the comm hook {name!r}'s state loaded on rank {rank} was saved by rank "
            f"{saved['rank']}: PowerSGD's error feedback is each rank's own, so the "
            "resumed run differs from the uninterrupted one. Save and load each rank's "
            "optimizer.state_dict() (or overlapkit.checkpoint with the optimizer).",
            UserWarning, stacklevel=4)
    try:  # everything read and converted before anything changes
        rng = saved["rng"]
        generator = np.random.RandomState()
        generator.set_state((rng["name"], rng["keys"].numpy().astype(np.uint32),
                             rng["pos"], rng["has_gauss"], rng["cached_gaussian"]))
        counters = {slot: saved[slot] for slot in _COUNTERS}
        # copies: the hook writes into them (``out=``) from the next backward on
        tensors = {slot: {int(k): v.detach().clone() for k, v in saved[slot].items()}
                   for slot in _TENSORS}
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(
            f"the comm hook {name!r}'s saved PowerSGD state is malformed "
            f"({type(error).__name__}: {error}); load what this optimizer's state_dict() "
            "returned. Nothing was loaded.") from error

    def load() -> None:
        state.rng = generator
        for slot, value in {**counters, **tensors}.items():
            setattr(state, slot, value)

    return load


class CommHookStateFacade(OverlappedOptimizerFacade):
    """The optimizers stepping a DDP model during backward (``overlap_ddp``'s, and
    ``optimizer_in_backward``'s on a DDP model): ``state_dict()`` and
    ``load_state_dict()`` with the comm hook's state (see the module)."""

    #: the name the comm hook was chosen by (``comm_hook=``), for messages
    _hook_name = "allreduce"

    def _warned(self) -> list[bool]:
        """Warned of, once each: an unknown state at state_dict(), at checkpoint.save()."""
        flags: list[bool] | None = self.__dict__.get("_hook_warned")
        if flags is None:
            flags = self.__dict__["_hook_warned"] = [False, False]
        return flags

    @property
    def comm_hook_state(self) -> Any:
        """The state of the comm hook this optimizer's model reduces with (what
        ``build_comm_hook(name)`` returns first: a ``PowerSGDState``, a process group)."""
        return getattr(self._steps, "inner_state", None)  # a BucketStepper's

    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        saved = saved_hook_state(self.comm_hook_state, self._hook_name, self._warned())
        if saved is not None:
            state_dict[KEY] = saved
        return state_dict

    def left_out_of_checkpoints(self) -> str | None:
        """What ``overlapkit.checkpoint.save`` warns of, once: the comm hook's state,
        each rank's own, which DCP's replicated optimizer state cannot hold."""
        warned = self._warned()
        if warned[1] or saved_hook_state(
                self.comm_hook_state, self._hook_name, [True]) is None:
            return None
        warned[1] = True
        return (f"overlapkit.checkpoint.save() does not hold the state of the comm hook "
                f"{self._hook_name!r}, each rank's own (PowerSGD's error feedback): "
                "a run resumed from the checkpoint alone starts that hook afresh. Save "
                "optimizer.state_dict() on every rank beside it (torch.save), and load it "
                "after checkpoint.load() with optimizer.load_state_dict().")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The real optimizer's ``load_state_dict``, and the comm hook's state where
        ``state_dict`` holds one (checked first: a refusal loads nothing)."""
        saved = state_dict.get(KEY) if isinstance(state_dict, Mapping) else None
        load_hook = hook_state_loader(self.comm_hook_state, self._hook_name, saved)
        super().load_state_dict(state_dict)
        load_hook()

