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

import operator
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import attrs
import torch
import torch.distributed as dist

from overlapkit.errors import ConfigurationError
from overlapkit.nodes.exit_safe import (
    DestinationsDifferError,
    TagsDifferError,
    gather_object,
)
from overlapkit.nodes.failed_collective import collective_failure
from overlapkit.overlap.core.watched_reads import quiet_reads
from overlapkit.overlap.sharded.gather_tag import gathering_tag, tags_differ_refusal
from overlapkit.overlap.sharded.ownership import Ownership

__all__ = ["SHARDED_STATE_KEY", "SHARDING_KEY", "Gathered", "check_sharded_state_dict",
           "changed_refusal", "destination_rank", "gather_state_dict", "load_pre_hooked",
           "not_gathered_refusal",
           "plain_state_dict", "share_fingerprint", "share_of", "sharded_state_dict",
           "stale_refusal",
           "with_state"]

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
    post-hooks see the whole state, as a plain optimizer's do.

    Its dicts are new ones on each call (the tensors are the gathered ones, as a plain
    optimizer's ``state_dict()`` hands out its own): the gathered dict itself, handed
    out, was changed by what was done to it (measured, 2 gloo ranks, AdamW: after
    torch's ``get_optimizer_state_dict``, which renames the state's keys in place,
    ``state_dict()`` was keyed by parameter names, so a plain optimizer loading it
    held no state for any parameter; an entry the loop deleted from one
    ``state_dict()`` was missing from the next)."""
    post = optimizer._optimizer_state_dict_post_hooks
    saved = dict(post)
    post.clear()
    try:
        out = optimizer.state_dict()
    finally:
        post.update(saved)
    out["state"] = {index: dict(entry) for index, entry in state.items()}
    for hook in saved.values():
        changed = hook(optimizer, out)
        if changed is not None:
            out = changed
    return out


def load_pre_hooked(optimizer: torch.optim.Optimizer, state_dict: Any, *, share: bool
                    ) -> tuple[Any, AbstractContextManager[Any]]:
    """A whole ``state_dict`` as the real optimizer's load pre-hooks hand it on (a
    shallow copy first, as torch's ``load_state_dict``), and a context leaving them out
    of the real load of this rank's share, which they have run for; else (``share``:
    torch's ``broadcast_from_rank0`` template, a ``local_state_dict()``, not a dict) the
    dict as given, the pre-hooks run by the real load on the share.

    A plain optimizer's pre-hooks see the whole dict; they saw this rank's share only
    (0.4.0: 5 and 4 of 9 entries at 2 ranks): a hook counting, checking or converting
    the whole dict failed or did less."""
    if share or not isinstance(state_dict, Mapping) or "state" not in state_dict:
        return state_dict, nullcontext()
    hooks = optimizer._optimizer_load_state_dict_pre_hooks
    out = dict(state_dict)
    for hook in list(hooks.values()):
        changed = hook(optimizer, out)
        if changed is not None:
            out = changed

    @contextmanager
    def left_out() -> Iterator[None]:
        saved = dict(hooks)
        hooks.clear()
        try:
            yield
        finally:
            hooks.update(saved)

    return out, left_out()


def destination_rank(to: Any, world_size: int) -> int:
    """``consolidate_state_dict(to=...)`` as a rank of the DDP model's process group:
    any integer, a NumPy one or a one-element integer tensor too (as
    ``ZeroRedundancyOptimizer`` takes them; refused up to 0.4.0, ``got
    np.int64(0)``), not a bool.

    :raises ConfigurationError: not an integer, or not a rank of the group."""
    try:
        rank = None if isinstance(to, bool) else operator.index(to)
    except TypeError:
        rank = None
    if rank is None or not 0 <= rank < world_size:
        raise ConfigurationError(
            f"consolidate_state_dict(to=...) takes a rank from 0 to {world_size - 1} "
            f"(the DDP model's process group), got {to!r}.")
    return rank


def not_gathered_refusal(gathered_on: int | None, rank: int) -> ConfigurationError:
    """``state_dict()`` at more than one rank without the whole state gathered on this
    rank (``gathered_on``: where it was, or None)."""
    where = "" if gathered_on is None else f" (it was gathered on rank {gathered_on})"
    # state_dict() on every rank after a gathering on one: a collective save (DCP's) of
    # what each returns would leave rank `gathered_on` waiting in it for this one
    collective = "" if gathered_on is None else (
        f" If every rank is calling state_dict() (or torch's get_state_dict / "
        "get_optimizer_state_dict) for a collective save such as "
        f"torch.distributed.checkpoint.save, rank {gathered_on} holds the whole state and "
        "waits in that save for this rank until the process group's timeout: call "
        f"state_dict() on rank {gathered_on} alone (torch.save), or pass the optimizer "
        "itself to the collective save on every rank (dcp.save({'optim': optimizer}) "
        "saves each rank's share, the plain optimizer's checkpoint).")
    return ConfigurationError(
        "the optimizer state is sharded across ranks, so state_dict() returns the whole "
        "state once it has been gathered on this rank, and it has not "
        f"been{where}. Call optimizer.consolidate_state_dict(to={rank}) on every rank "
        f"first (the same `to` on each), then state_dict() on rank {rank}; or save with "
        "overlapkit.checkpoint.save(path, model, optimizer) on every rank (no gathering, "
        "loads at any world size); local_state_dict() is this rank's share." + collective)


def stale_refusal() -> ConfigurationError:
    """``state_dict()`` after a step since the gathering."""
    return ConfigurationError(
        "the state dict gathered by consolidate_state_dict() is stale: the optimizer has "
        "stepped since. Call consolidate_state_dict() on every rank again after the last "
        "step you want to save, then state_dict().")


@attrs.frozen
class Gathered:
    """Where and when ``consolidate_state_dict()`` last gathered the whole state; the
    state itself is the stepper's ``consolidated`` (released at the next step)."""

    to: int
    generation: int
    #: this rank's share as gathered (:func:`share_fingerprint`), on rank ``to`` only
    share: list[tuple[int, str, Any]] | None = None


def share_fingerprint(optimizer: torch.optim.Optimizer, ownership: Ownership
                      ) -> list[tuple[int, str, Any]]:
    """What this rank's share of the state is now, cheaply: per owned parameter and
    state entry, its tensor (``id`` and autograd version counter, which every in-place
    write bumps) or its value. Taken at ``consolidate_state_dict()`` and compared at
    ``state_dict()`` on rank ``to`` (:func:`changed_refusal`); no copy, no
    communication."""
    out: list[tuple[int, str, Any]] = []
    state = optimizer.state
    with quiet_reads():  # overlapkit's read, not the loop's (the first window's watch)
        for index in sorted(ownership.my_indices()):
            entry = state.get(ownership.params[index])
            for key, value in (entry or {}).items():
                out.append((index, key, (id(value), value._version)
                            if isinstance(value, torch.Tensor) else value))
    return out


def changed_refusal(recorded: list[tuple[int, str, Any]], now: list[tuple[int, str, Any]],
                    ownership: Ownership, names: Mapping[int, str]
                    ) -> ConfigurationError | None:
    """``state_dict()`` after this rank's share of the state was changed since it was
    gathered (an entry written in place, replaced, added or deleted), else None:
    the gathered dict would hold the state as it was (measured: 0.0169 off the plain
    optimizer's dict after Adam's ``exp_avg`` was zeroed, 2 gloo ranks, AdamW, as
    ``ZeroRedundancyOptimizer``'s is)."""
    if recorded == now:
        return None
    before = {(index, key): value for index, key, value in recorded}
    after = {(index, key): value for index, key, value in now}
    changed = sorted(key for key in before.keys() | after.keys()
                     if before.get(key, before) != after.get(key, before))
    named = ", ".join(f"{names.get(id(ownership.params[index]), f'#{index}')}[{key!r}]"
                      for index, key in changed[:3])
    return ConfigurationError(
        "the optimizer state changed on this rank since consolidate_state_dict() gathered "
        f"it ({named}{', ...' if len(changed) > 3 else ''}), so the gathered state dict "
        "is stale: state_dict() would return the state as it was. Call "
        "consolidate_state_dict() on every rank again after the last step() or change "
        "you want to save, then state_dict(). Nothing was returned.")


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
        gathered = gather_object(mine, dst=dist.get_global_rank(group, to), group=group,
                                 tag=gathering_tag(ownership, local["param_groups"]))
    except TagsDifferError as error:
        raise tags_differ_refusal(error.tags, ownership) from None
    except DestinationsDifferError as error:
        named = [dist.get_group_rank(group, each) for each in error.destinations]
        raise ConfigurationError(
            "consolidate_state_dict(to=...) named different ranks on the ranks of the DDP "
            f"model's process group: {named} (the `to` of each rank, in rank order), so "
            "nothing was gathered. Name the same rank on every rank, e.g. "
            "consolidate_state_dict(to=0), then call state_dict() on that rank."
        ) from None
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
