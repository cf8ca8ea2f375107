"""The parameters a sharded optimizer holds, against its ownership: ``param_groups``
edited by hand.

A plain optimizer lets a loop replace or reorder its ``param_groups``
(``opt.param_groups = [...]``) or edit them in place (``opt.param_groups.append(g)``,
``group["params"] = ...``). A sharded optimizer assigned every parameter to its owner
when it was added, and its state dicts number the parameters in ``param_groups`` order.
Measured before this check (2 gloo ranks, AdamW): groups reordered by hand kept
training bitwise, but the gathered state dict lost entries and ``local_state_dict()``
held 3 of rank 0's 5 parameters; a group appended by hand was never stepped by any
rank, and a parameter removed by hand was still stepped (0.013-0.020 off the plain
optimizer after 2 steps), both without a word.

So the same parameters in another order are followed (the ownership is reordered with
them: nothing changes hands), and parameters added or removed this way are refused
before anything steps with them, saying to use ``add_param_group``.

.. versionadded:: 0.4
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import is_
from typing import Any

import torch

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.sharded.ownership import Ownership

__all__ = ["flat_params", "reordered"]


def flat_params(groups: Sequence[dict[str, Any]]) -> list[torch.Tensor]:
    """Every parameter of ``groups``, group by group (``state_dict()`` order)."""
    out: list[torch.Tensor] = []
    for group in groups:
        params = group.get("params", ()) if isinstance(group, dict) else ()
        out.extend([params] if isinstance(params, torch.Tensor) else params)
    return out


def reordered(ownership: Ownership, held: Sequence[torch.Tensor]) -> Ownership | None:
    """The ownership of ``held`` (the parameters ``param_groups`` hold now, in order):
    None when they are the ownership's own, in its order; the same owners in the new
    order when only the order changed.

    :raises ConfigurationError: parameters were added or removed by editing
        ``param_groups`` (or one is listed twice), not through ``add_param_group``.
    """
    known = ownership.params
    if len(held) == len(known) and all(map(is_, held, known)):
        return None
    ids = [id(p) for p in held]
    added = sum(1 for p in held if ownership.owner_of(p) is None)
    removed = len({id(p) for p in known} - set(ids))
    if added or removed or len(set(ids)) != len(ids):
        twice = len(ids) - len(set(ids))
        what = ", ".join(part for part in (
            f"{added} added" if added else "", f"{removed} removed" if removed else "",
            f"{twice} listed twice" if twice else "") if part)
        raise ConfigurationError(
            f"the parameters of this sharded optimizer's param_groups were changed by hand "
            f"({what}; it held {len(known)}, now {len(held)}). Each parameter was "
            "assigned to the rank that steps it and keeps its state when it was added, so "
            "one added by editing param_groups would never be stepped, and one removed "
            "would still be. Nothing has been stepped with the change. Add parameters "
            "with optimizer.add_param_group({'params': [...]}) on every rank (put "
            "param_groups back as they were first); to drop parameters, freeze them "
            "(requires_grad=False before wrapping the model) or build a new optimizer "
            "and load the old one's state dict. Hyperparameters (lr, betas, "
            "weight_decay, ...) and the order of the groups may be changed freely."
        )
    return Ownership(list(held), [ownership.owner_of(p) for p in held],  # type: ignore[misc]
                     ownership.rank, ownership.world_size, identity=ownership.identity)
