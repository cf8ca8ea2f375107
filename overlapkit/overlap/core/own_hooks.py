"""Hooks a technique puts on the user's model, made to travel with it as no-ops.

``torch.save(model)`` and ``copy.deepcopy(model)`` (an EMA copy,
``torch.optim.swa_utils.AveragedModel``) take the model's hook dictionaries along. A
closure there made ``torch.save`` raise pickle's bare "Can't pickle local object",
where the plain model saves; and a copied guard ran on the copy as on the trained
model (``optimizer_in_backward``'s refused the EMA copy's forward: its parameters are
not the ones set up). An :class:`OwnHook` is pickled and copied as a hook that does
nothing: the copy is a plain model, as a copy of a plainly trained one is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["OwnHook"]


class OwnHook:
    """``function(*hook_args, *bound)`` as a module hook; a no-op once copied or
    unpickled."""

    def __init__(self, function: Callable[..., Any] | None, *bound: Any) -> None:
        self._function = function
        self._bound = bound

    def __call__(self, *hook_args: Any) -> Any:
        if self._function is None:
            return None
        return self._function(*hook_args, *self._bound)

    def __reduce__(self) -> tuple[Any, ...]:
        # copy.deepcopy and pickle both go through __reduce_ex__, which uses this
        return (OwnHook, (None,))
