"""Gradient clipping applied to the gradients an overlapped step is about to use.

Clamping by value is elementwise, so it is exactly ``clip_grad_value_`` whenever it is
applied. Clipping by norm is a global decision — the total norm of every gradient
scales each one — so by default (``scope="global"``) the steps wait for the end of
backward (:mod:`overlapkit.overlap.rules.global_step`) and the result is
``torch.nn.utils.clip_grad_norm_(params, max_norm)`` before ``step()``, bitwise.
``scope="bucket"`` keeps 0.1's behaviour: each part (a DDP bucket, a parameter) is
clipped by its own norm and stepped as soon as it is reduced.
"""

from __future__ import annotations

import math

import attrs
import torch

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.rules.late_clipping import (
    unguarded_clip_grad_norm_,
    unguarded_clip_grad_value_,
)

__all__ = ["SCOPES", "GradClipping"]

#: what ``clip_grad_norm_scope`` may be
SCOPES = ("global", "bucket")


def _positive_or_none(name: str, value: float | None, *, infinite: bool = False) -> None:
    """``infinite``: ``inf`` is accepted too (``clip_grad_norm_(params, inf)`` computes the
    norm and scales by exactly 1.0: how the Hugging Face Trainer logs the norm unclipped)."""
    if value is not None and not (
        isinstance(value, (int, float)) and not isinstance(value, bool)
        and (math.isfinite(value) or (infinite and value == math.inf)) and value > 0
    ):
        what = "positive number (inf included)" if infinite else "positive finite number"
        raise ConfigurationError(f"{name} must be a {what} or None, got {value!r}.")


@attrs.frozen(kw_only=True)
class GradClipping:
    """What to clip before each overlapped step; validated when built.

    :param value: clamp every gradient to ``[-value, value]`` (``clip_grad_value_``).
    :param norm: scale the gradients of each stepped part so that their
        ``norm_type``-norm is at most ``norm`` (``clip_grad_norm_`` on the part).
    :param norm_type: the norm of ``norm`` (2.0, ``inf``, ...).
    :param scope: ``"global"``: the norm of every gradient the optimizer steps, as
        ``clip_grad_norm_``; ``"bucket"``: the norm of each part stepped.
    """

    value: float | None = None
    norm: float | None = None
    norm_type: float = 2.0
    scope: str = "global"

    def __attrs_post_init__(self) -> None:
        _positive_or_none("clip_grad_value", self.value)
        _positive_or_none("clip_grad_norm", self.norm, infinite=True)
        if not isinstance(self.norm_type, (int, float)) or isinstance(self.norm_type, bool) \
                or not (self.norm_type > 0):
            raise ConfigurationError(
                f"clip_norm_type must be a positive number (2.0, float('inf'), ...), got "
                f"{self.norm_type!r}."
            )
        if self.scope not in SCOPES:
            raise ConfigurationError(
                f"clip_grad_norm_scope must be one of {', '.join(map(repr, SCOPES))}, got "
                f"{self.scope!r}: 'global' clips as torch.nn.utils.clip_grad_norm_ over "
                "every gradient (the steps wait for the end of backward), 'bucket' clips "
                "each part stepped by its own norm."
            )

    @property
    def enabled(self) -> bool:
        """Whether anything is clipped."""
        return self.value is not None or self.norm is not None

    def apply(self, params: list[torch.Tensor]) -> None:
        """Clip the ``.grad`` of one part's ``params`` in place: by value, then by norm
        (the part's own norm; used when the steps do not wait for a global decision)."""
        if self.value is not None:
            unguarded_clip_grad_value_(params, self.value)
        if self.norm is not None:
            unguarded_clip_grad_norm_(params, self.norm, norm_type=self.norm_type)
