"""Gradient clipping applied to the gradients an overlapped step is about to use.

An overlapped optimizer steps part of the model (one DDP bucket, one parameter) before
the other gradients exist, so clipping can only see that part: clamping by value is
exactly ``clip_grad_value_`` after backward, clipping by norm is per part (per bucket,
or per parameter), never the global ``clip_grad_norm_``. See the docs of
:func:`overlapkit.overlap_ddp` and :func:`overlapkit.optimizer_in_backward`.
"""

from __future__ import annotations

import math

import attrs
import torch

from overlapkit.errors import ConfigurationError

__all__ = ["GradClipping"]


def _positive_or_none(name: str, value: float | None) -> None:
    if value is not None and not (
        isinstance(value, (int, float)) and not isinstance(value, bool)
        and math.isfinite(value) and value > 0
    ):
        raise ConfigurationError(
            f"{name} must be a positive finite number or None, got {value!r}."
        )


@attrs.frozen(kw_only=True)
class GradClipping:
    """What to clip before each overlapped step; validated when built.

    :param value: clamp every gradient to ``[-value, value]`` (``clip_grad_value_``).
    :param norm: scale the gradients of each stepped part so that their
        ``norm_type``-norm is at most ``norm`` (``clip_grad_norm_`` on the part).
    :param norm_type: the norm of ``norm`` (2.0, ``inf``, ...).
    """

    value: float | None = None
    norm: float | None = None
    norm_type: float = 2.0

    def __attrs_post_init__(self) -> None:
        _positive_or_none("clip_grad_value", self.value)
        _positive_or_none("clip_grad_norm", self.norm)
        if not isinstance(self.norm_type, (int, float)) or isinstance(self.norm_type, bool) \
                or not (self.norm_type > 0):
            raise ConfigurationError(
                f"clip_norm_type must be a positive number (2.0, float('inf'), ...), got "
                f"{self.norm_type!r}."
            )

    @property
    def enabled(self) -> bool:
        """Whether anything is clipped."""
        return self.value is not None or self.norm is not None

    def apply(self, params: list[torch.Tensor]) -> None:
        """Clip the ``.grad`` of ``params`` in place: by value, then by norm."""
        if self.value is not None:
            torch.nn.utils.clip_grad_value_(params, self.value)
        if self.norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.norm, norm_type=self.norm_type)
