"""The state dicts of a sharded optimizer: gathered whole on one rank, or one rank's
share, and loading either back.

Each rank's real optimizer holds every parameter in its ``param_groups`` and the state of
the parameters it owns, so its ``state_dict()`` has the plain format with the state of
one share; the shares' states are disjoint, so the whole one is their union
(:func:`gather_state_dict`), which loads into a plain optimizer of the same class, into
``overlap_ddp`` without sharding, or into a sharded one at any world size (each rank
keeps its share: :func:`share_of`). A single rank's share is saved as a *sharded state
dict* (:func:`sharded_state_dict`), which records the ownership it belongs to and loads
only where the ownership is the same: a share loaded elsewhere would leave parameters
without their state, silently. ``overlapkit.checkpoint`` needs neither: it writes each
rank's share to one DCP checkpoint and reads it back at any world size.

.. versionadded:: 0.3
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.errors import ConfigurationError
from overlapkit.nodes.exit_safe import gather_object
from overlapkit.nodes.failed_collective import collective_failure
from overlapkit.overlap.sharded.ownership import Ownership

__all__ = ["SHARDED_STATE_KEY", "SHARDING_KEY", "TEMPLATE_DEVICE_KEY",
           "check_sharded_state_dict", "gather_state_dict", "in_torch_s_initialising_step",
           "load_template", "plain_state_dict", "share_of", "sharded_state_dict",
           "torch_s_load_template", "with_state"]

#: where a sharded state dict keeps its share of the state (not "state": a plain
#: optimizer's ``load_state_dict`` then fails at once instead of loading a share silently)
SHARDED_STATE_KEY = "sharded_state"
#: where a sharded state dict records its ownership
SHARDING_KEY = "sharding"


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def plain_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` without its state-dict hooks (they run once, on the
    dict the user gets: :func:`with_state`)."""
    pre, post = optimizer._optimizer_state_dict_pre_hooks, \
        optimizer._optimizer_state_dict_post_hooks
    saved = dict(pre), dict(post)
    pre.clear()
    post.clear()
    try:
        return optimizer.state_dict()
    finally:
        pre.update(saved[0])
        post.update(saved[1])


def with_state(optimizer: torch.optim.Optimizer, state: dict[int, Any]) -> dict[str, Any]:
    """The real optimizer's ``state_dict()`` (its pre-hooks, current param groups, its
    post-hooks' entries) with ``state`` (the whole, gathered state) as its state: the
    post-hooks see the whole state, as a plain optimizer's do."""
    post = optimizer._optimizer_state_dict_post_hooks
    saved = dict(post)
    post.clear()
    try:
        out = optimizer.state_dict()
    finally:
        post.update(saved)
    out["state"] = state
    for hook in saved.values():
        changed = hook(optimizer, out)
        if changed is not None:
            out = changed
    return out


def _torch_frame(name: str, depth: int) -> Any:
    """The frame of ``torch.distributed.checkpoint.state_dict``'s function ``name`` among
    the ``depth`` callers of this function's caller, or None (looked up by its code:
    torch may wrap the functions between, so an ordinary call is never mistaken for
    it)."""
    try:
        from torch.distributed.checkpoint import state_dict as torch_state_dict
    except ImportError:  # pragma: no cover - torch without torch.distributed
        return None
    function = getattr(torch_state_dict, name, None)
    # torch.no_grad() wraps some of them: their own code, not the shared wrapper's
    code = getattr(inspect.unwrap(function), "__code__", None) if function else None
    if code is None:
        return None
    frame = sys._getframe(2)
    for _ in range(depth):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        if frame.f_code is code:
            return frame
    return None


def in_torch_s_initialising_step() -> bool:
    """Whether the optimizer's ``step()`` is being called by torch's
    ``torch.distributed.checkpoint.state_dict`` to create the optimizer state before
    reading or loading it (``_init_optim_state``: zero gradients, ``lr`` 0, one step,
    on a rank whose ``optimizer.state`` is empty).

    Each rank decides alone whether to take that step, from its own ``state``, which
    with sharded state holds its share only: a rank owning nothing (or only parameters
    without state) took it while the others did not, and its parameter exchange waited
    for them until the group's timeout (``ExchangeFailedError``, every later call
    refused)."""
    return _torch_frame("_init_optim_state", 6) is not None


def torch_s_load_template() -> Mapping[str, Any] | None:
    """When ``state_dict()`` is being called by torch's ``set_optimizer_state_dict`` with
    ``StateDictOptions(full_state_dict=True)`` (``_load_optim_state_dict``), the dict
    being loaded on this rank (``{}`` on a rank given none: ``broadcast_from_rank0``);
    else None.

    torch reads the optimizer's own state dict there as the template of what this rank
    loads, fills it from the whole dict (or from rank 0's broadcast), then hands it to
    ``load_state_dict``: the template of a sharded optimizer is built by
    :func:`load_template`."""
    frame = _torch_frame("_load_optim_state_dict", 8)
    if frame is None:
        return None
    given = frame.f_locals.get("optim_state_dict")
    return given if isinstance(given, Mapping) else {}


#: the state entry a rank holding no tensor state puts in its load template
#: (:func:`load_template`), under a parameter another rank owns
TEMPLATE_DEVICE_KEY = "overlapkit_template_device"


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() > 0
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    return False


def load_template(local: dict[str, Any], ownership: Ownership,
                  given: Mapping[str, Any]) -> dict[str, Any]:
    """What torch's ``set_optimizer_state_dict(..., full_state_dict=True)`` reads as this
    rank's state dict (:func:`torch_s_load_template`; ``given``: the dict it loads on
    this rank). ``local`` is the real optimizer's own (the param groups and this
    rank's share of the state); ``load_state_dict`` keeps this rank's share of what
    torch fills in, as without the option.

    Taken as it is, that template failed in two ways (2 gloo ranks, AdamW; the plain
    optimizer loads both): every rank given the whole dict, torch copied each scalar
    entry (``step``) of another rank's parameters into it without the path to put it
    back (its bare ``KeyError: 'state.embed.weight.step'``); and a rank whose share
    holds no tensor (it owns nothing, or only parameters without state) left torch no
    device to load onto (its bare ``AssertionError``, that rank alone, the others
    waiting in the broadcast). So the other ranks' parameters of ``given`` are in the
    template too (their tensors as empty ones on the parameter's device, their scalars
    as given), and a rank still without a tensor gets one empty tensor under a
    parameter another rank owns; ``load_state_dict`` drops both with the rest of the
    other ranks' share."""
    owned = ownership.my_indices()
    state = dict(local["state"])
    given_state = given.get("state")
    if isinstance(given_state, Mapping):
        saved = [key for group in given.get("param_groups", ()) for key in group["params"]]
        for index, key in enumerate(saved[:len(ownership.params)]):
            entry = given_state.get(key)
            if index in owned or not isinstance(entry, Mapping):
                continue
            device = ownership.params[index].device
            state[index] = {name: torch.empty(0, dtype=value.dtype, device=device)
                            if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                            for name, value in entry.items()}
    if not _holds_tensor(state):
        other = next((index for index in range(len(ownership.params))
                      if index not in owned), None)
        if other is not None:  # (else this rank owns everything: torch's error, as plain)
            param = ownership.params[other]
            state[other] = {**state.get(other, {}), TEMPLATE_DEVICE_KEY: torch.empty(
                0, dtype=param.dtype, device=param.device)}
    return {**local, "state": state}


def gather_state_dict(local: dict[str, Any], ownership: Ownership, group: Any,
                      to: int) -> dict[str, Any] | None:
    """The whole state dict, on rank ``to`` of ``group`` (None elsewhere), from each
    rank's ``local`` one (its real optimizer's ``state_dict()``). A collective: every
    rank calls it (a rank that does not makes the others raise
    :class:`~overlapkit.errors.ExchangeFailedError` naming it at the group's timeout,
    not gloo's bare ``RuntimeError``). The state's tensors are copies on the CPU (as
    ``ZeroRedundancyOptimizer.consolidate_state_dict`` keeps them): the gathering rank
    holds every rank's state.

    Only the owner's entry of each parameter is sent: reading ``optimizer.state[p]`` (a
    defaultdict) on a rank that does not own ``p`` stores an empty entry there, which
    overwrote the owner's state when every rank's entries were merged (measured: one
    parameter's Adam state missing at 2 ranks, two at 3; resuming restarted Adam for
    them)."""
    what = (f"gathering the sharded optimizer state on rank {to} "
            "(consolidate_state_dict(), which every rank of the DDP model's process group "
            "calls)")
    owned = ownership.my_indices()
    mine = _to_cpu({index: value for index, value in local["state"].items()
                    if index in owned})
    if ownership.world_size == 1:
        return {"state": mine, "param_groups": local["param_groups"]}
    # the collective a ZeRO script ends with before rank ``to`` saves: gloo's threads
    # must not need the GIL for its tensors (overlapkit.nodes.exit_safe)
    try:
        gathered = gather_object(mine, dst=dist.get_global_rank(group, to), group=group)
    except Exception as error:
        # a rank that skipped its consolidate_state_dict(): gloo's bare timeout, named
        failed = collective_failure(error, what, group)
        if failed is None:
            raise
        raise failed from error
    if gathered is None:
        return None
    state: dict[int, Any] = {}
    for share in gathered:
        state.update(share)
    return {"state": dict(sorted(state.items())),
            "param_groups": _to_cpu(local["param_groups"])}


def sharded_state_dict(local: dict[str, Any], ownership: Ownership) -> dict[str, Any]:
    """This rank's share as a sharded state dict: the param groups, the share's state
    (only the parameters this rank owns), the ownership it belongs to, and any entry a
    state-dict post-hook added."""
    owned = ownership.my_indices()
    extra = {key: value for key, value in local.items() if key != "state"}
    return {**extra, SHARDED_STATE_KEY: {index: value for index, value
                                         in local["state"].items() if index in owned},
            SHARDING_KEY: ownership.describe()}


def check_sharded_state_dict(state_dict: Mapping[str, Any], ownership: Ownership) -> None:
    """:raises ConfigurationError: ``state_dict`` is a sharded state dict of another
    world size, another ownership or another rank."""
    saved = state_dict.get(SHARDING_KEY)
    here = ownership.describe()
    if not isinstance(saved, Mapping) or not {"world_size", "rank", "owners"} <= set(saved):
        raise ConfigurationError(
            f"this sharded state dict has no valid {SHARDING_KEY!r} record; load the state "
            "dict local_state_dict() returned, unchanged."
        )
    if saved["world_size"] != here["world_size"]:
        raise ConfigurationError(
            f"this sharded state dict was saved by rank {saved['rank']} of "
            f"{saved['world_size']} ranks and holds the optimizer state of that rank's "
            f"share only, so it cannot be loaded at {here['world_size']} ranks (other "
            "parameters would start without state). Nothing was changed. Load it at "
            f"{saved['world_size']} ranks, or save a whole state dict instead: "
            "optimizer.consolidate_state_dict(to=0) on every rank, then "
            "optimizer.state_dict() on rank 0 (it loads at any world size), or "
            "overlapkit.checkpoint.save/load, which reshard."
        )
    if list(saved["owners"]) != here["owners"]:
        raise ConfigurationError(
            "this sharded state dict was saved with another assignment of parameters to "
            "ranks (another sharding policy, or other parameters), so its share is not "
            "this rank's. Nothing was changed. Save a whole state dict instead "
            "(consolidate_state_dict, then state_dict()), or use "
            "overlapkit.checkpoint.save/load."
        )
    if saved["rank"] != here["rank"]:
        raise ConfigurationError(
            f"this sharded state dict holds rank {saved['rank']}'s share and is being "
            f"loaded on rank {here['rank']}. Nothing was changed. Each rank loads the "
            "one it saved (e.g. torch.save(opt.local_state_dict(), f'optim-{rank}.pt'))."
        )


def share_of(state_dict: Mapping[str, Any], ownership: Ownership) -> dict[str, Any]:
    """The plain-format state dict this rank's real optimizer loads from
    ``state_dict`` — a whole state dict (any world size) or this rank's sharded one
    (checked by :func:`check_sharded_state_dict`): the param groups and the state of
    the parameters this rank owns.

    :raises ConfigurationError: not an optimizer state dict; a sharded one that is not
        this rank's.
    """
    if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict or not (
            "state" in state_dict or SHARDED_STATE_KEY in state_dict):
        raise ConfigurationError(
            "load_state_dict expects an optimizer state dict (with 'state' and "
            f"'param_groups', or a sharded one from local_state_dict()), got "
            f"{type(state_dict).__name__}"
            + (f" with keys {sorted(map(str, state_dict))}"
               if isinstance(state_dict, Mapping) else "")
            + "; pass what state_dict() or local_state_dict() returned."
        )
    # entries other than the state are handed on as given: the load pre-hooks see them
    if SHARDED_STATE_KEY in state_dict:
        check_sharded_state_dict(state_dict, ownership)
        extra = {key: value for key, value in state_dict.items()
                 if key not in (SHARDED_STATE_KEY, SHARDING_KEY)}
        return {**extra, "state": dict(state_dict[SHARDED_STATE_KEY])}
    # a state entry belongs to the parameter at its key's position in the saved param
    # groups, as a plain optimizer's load_state_dict maps it: the keys need not be
    # 0..n-1 (torch's set_optimizer_state_dict hands over parameter names, which were
    # all dropped when the key itself was taken for the position)
    mine = ownership.my_indices()
    saved = [key for group in state_dict["param_groups"] for key in group["params"]]
    position = {key: index for index, key in enumerate(saved)}
    return {**state_dict, "state": {key: value for key, value in state_dict["state"].items()
                                    if position.get(key) in mine}}
