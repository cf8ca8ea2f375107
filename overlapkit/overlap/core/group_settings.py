"""The settings of an optimizer's param groups (``lr``, ``betas``, ``weight_decay``, ...)
as a step reads them: recorded when a backward ends, compared at ``step()``.

A step taken during backward uses the settings of that moment. A loop that changes one
between ``backward()`` and ``step()`` — a warm-up written by hand (nanoGPT's and llm.c's
loops set the learning rate there), an LR scheduler stepped before the optimizer — means
it for the step that follows, which the plain ``step()`` takes with the new value
(measured on the 0.4 probe: a hand-written warm-up under Accelerate 0.0117 off the plain
run after 4 steps, silently). :mod:`~overlapkit.overlap.core.window` learns such a loop
from its first step, or refuses a change after a stepping backward.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["changed_settings", "settings"]


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()  # a tensor lr is changed in place (fill_)
    return tuple(map(_copied, value)) if isinstance(value, tuple | list) else value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


#: group entries no step reads: the parameters, and ``initial_lr``, which an LR
#: scheduler adds when it is built (one built between backward and ``step()`` changes
#: nothing the step reads)
_NOT_READ = frozenset({"params", "initial_lr"})


def settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings but its parameters (``lr``, ``betas``, ...), as a
    step taken now reads them."""
    return [{key: _copied(value) for key, value in group.items() if key not in _NOT_READ}
            for group in optimizer.param_groups]


def changed_settings(before: list[dict[str, Any]],
                     optimizer: torch.optim.Optimizer) -> list[str]:
    """The settings of ``optimizer``'s param groups that differ from ``before``
    (:func:`settings`), named as ``"lr of param group 0"``."""
    groups = optimizer.param_groups
    if len(groups) != len(before):
        return ["param groups"]
    found = []
    for index, (was, group) in enumerate(zip(before, groups, strict=True)):
        for key in sorted((set(was) | set(group)) - _NOT_READ):
            if key not in was or key not in group or not _same(was[key], group[key]):
                found.append(f"{key} of param group {index}")
    return found
