"""What a gathering of a sharded optimizer's state tells the other ranks first: which
optimizer it gathers, and in which order its param groups list the parameters.

``consolidate_state_dict()`` sends a tag with the sizes it sends first
(:func:`overlapkit.nodes.exit_safe.gather_object`): ranks gathering different
optimizers (a GAN's two, called in another order on different ranks) would pair each
other's shares, silently. The whole state dict is indexed by the parameters' positions
in the param groups, so the tag also covers that order: a loop that reorders one
group's parameters on some ranks only (``opt.param_groups[0]["params"].reverse()`` under
``if rank == 0:``; the steps follow it, bitwise) would merge shares indexed two ways.

The tag has two halves, so that the refusal says which it is: the optimizer's identity
(agreed at set-up) and the layout (the parameters' shapes, dtypes and owners in
param-group order, the groups' setting names). Computed at each gathering only, nothing
per step.

.. versionadded:: 0.4
"""

from __future__ import annotations

import hashlib
from typing import Any

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.sharded.ownership import Ownership

__all__ = ["gathering_tag", "tags_differ_refusal"]

_HALF = 28  # bits per half: the tag travels as one int64


def _digest(described: Any) -> int:
    digest = hashlib.sha256(repr(described).encode()).digest()
    return int.from_bytes(digest[:4], "big") >> (32 - _HALF)


def gathering_tag(ownership: Ownership, groups: list[dict[str, Any]]) -> int:
    """The tag of this rank's gathering: which optimizer (its identity, agreed by its
    ranks at set-up, :attr:`~overlapkit.overlap.sharded.ownership.Ownership.identity`)
    in the high half; its layout (its parameters' shapes, dtypes and owners in
    param-group order, the setting names of its param groups) in the low half.

    Two sharded optimizers on one process group, each gathered on some ranks at once,
    were paired (measured: 2 gloo ranks, the gathered dict of one held the other's
    state under its indices, a (6,) ``exp_avg`` for a (16,) parameter, silently); so
    were two of one class over parameters of the same shapes until the identity (the
    dict of one held the other's ``step`` counts, 4 of 9 at 2 ranks)."""
    layout: list[Any] = [(tuple(p.shape), str(p.dtype), owner)
                         for p, owner in zip(ownership.params, ownership.owners, strict=True)]
    layout += [sorted(key for key in group if key != "params") for group in groups]
    return (_digest(ownership.identity) << _HALF) | _digest(layout)


def tags_differ_refusal(tags: list[int], ownership: Ownership) -> ConfigurationError:
    """The refusal on every rank when the ranks' tags differ (``tags``: each rank's, in
    group order): different optimizers, or one optimizer whose param groups list the
    parameters (or name settings) differently on some ranks."""
    if len({tag >> _HALF for tag in tags}) > 1:
        return ConfigurationError(
            "consolidate_state_dict() was called for different optimizers on the ranks "
            "of the DDP model's process group (each optimizer built by its own "
            "overlap_ddp call, even over parameters of the same shapes; this rank's has "
            f"{len(ownership.params)} parameters), so nothing "
            "was gathered: the whole state dict would have mixed their states. Call it "
            "for the same optimizer on every rank, in the same order (every rank "
            "gathers one optimizer, then the next).")
    alike: dict[int, list[int]] = {}
    for rank, tag in enumerate(tags):
        alike.setdefault(tag, []).append(rank)
    orders = " and ".join(str(ranks) for ranks in alike.values())
    return ConfigurationError(
        "consolidate_state_dict() found this optimizer's param_groups listing its "
        "parameters in different orders (or with other setting names) on its ranks "
        f"(an order each on ranks {orders}, group ranks). The whole state dict is "
        "indexed by the parameters' positions in param_groups, so nothing was gathered: "
        "the ranks' shares would have been merged under different orders. Give param_groups the "
        "same order on every rank (reorder them on every rank, or on none), or save "
        "by parameter name: overlapkit.checkpoint.save(path, model, optimizer) on every "
        "rank.")
