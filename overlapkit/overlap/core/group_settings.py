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

import operator
from typing import Any

import torch

from overlapkit.overlap.core.data_writes import same_bits

__all__ = ["changed_params", "changed_settings", "settings"]


class _TensorSetting:
    """A tensor setting (a tensor ``lr``, changed in place by ``fill_``) as recorded:
    the tensor, its version, and a copy of its value."""

    __slots__ = ("tensor", "value", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version
        self.value = tensor.detach().clone()

    def same_as(self, now: Any) -> bool:
        if now is self.tensor and now._version == self.version:
            return True  # untouched: no comparison of values (a host sync on an accelerator)
        return (isinstance(now, torch.Tensor) and now.shape == self.value.shape
                and same_bits(self.value, now))


class _Params:
    """A param group's ``params`` as recorded: the list and its length (the parameters
    a step takes). One removed or added, or the list replaced by one of other
    parameters: a step taken during backward stepped the group as it was. The list
    itself is kept, not copied: one replaced still holds the parameters it had (an
    item of the same list set in place, its length kept, is not seen)."""

    __slots__ = ("count", "params")

    def __init__(self, params: list[Any]) -> None:
        self.params, self.count = params, len(params)

    def same_as(self, now: Any) -> bool:
        was = self.params
        if now is was:
            return len(now) == self.count
        return (isinstance(now, list | tuple) and len(now) == self.count == len(was)
                and all(map(operator.is_, now, was)))


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _TensorSetting(value)
    return tuple(map(_copied, value)) if isinstance(value, tuple | list) else value


def _same(was: Any, now: Any) -> bool:
    if isinstance(was, _TensorSetting | _Params):
        return was.same_as(now)
    if isinstance(now, torch.Tensor):
        return False
    if isinstance(was, tuple) and isinstance(now, tuple | list):
        return len(was) == len(now) and all(map(_same, was, now))
    return bool(was == now)


#: group entries no step reads: ``initial_lr``, which an LR scheduler adds when it is
#: built (one built between backward and ``step()`` changes nothing the step reads)
_NOT_READ = frozenset({"initial_lr"})


def settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings (``lr``, ``betas``, ...) and parameters, as a step
    taken now reads them."""
    return [{key: _Params(value) if key == "params" else _copied(value)
             for key, value in group.items() if key not in _NOT_READ}
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


def changed_params(changed: list[str]) -> list[str]:
    """The param groups (``"param group 0"``) among ``changed`` (the names
    :func:`changed_settings` gives) whose parameters changed: one removed, added or
    the list replaced."""
    return [name[len("params of "):] for name in changed if name.startswith("params of ")]
