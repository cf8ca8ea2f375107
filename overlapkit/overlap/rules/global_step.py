"""Steps that wait for a global decision: clipping by the global norm, and a
``torch.amp.GradScaler``'s unscale and inf check.

Both need every gradient of the backward: the total norm scales every gradient, and an
inf anywhere skips the whole step. An overlapped step taken part by part during
backward cannot know either, so with ``clip_grad_norm=`` (global scope, the default)
or ``grad_scaler=`` the parts are not stepped as their gradients arrive: the
allreduces still overlap backward, and at the end of backward — after DDP's finalize,
when every reduced gradient is in ``.grad`` — the gradients are unscaled and checked as
``GradScaler.unscale_`` does it, clipped as ``torch.nn.utils.clip_grad_norm_`` does it
(same functions, same parameter order), and all owned parameters are stepped in one
call, or none when an inf was found. That is plain DDP's step, moved into backward:
bitwise the same result, and no overlap of the step itself.

*The parameter order.* torch's total norm is a norm of the per-tensor norms, which
rounds differently in another order (measured on torch 2.13: 36 of 200 random trials
differ in the last bit in one process; 2.98e-08 off the plain loop after 6 steps with the
usual no-decay/decay groups, biases first). The gradients are therefore clipped in
``model.parameters()`` order — what the plain loop's ``clip_grad_norm_(model.parameters(),
max_norm)`` uses — whatever the optimizer's param groups (:func:`model_order`).

*The full step.* A ``step()`` after backwards that stepped nothing (only ``no_sync()`` /
``no_step()`` backwards, or ``.grad`` set by hand) is an ordinary step of every
parameter with a gradient, and applies the same rules in the same order — unscale and
inf check with a scaler, value clipping, norm clipping, the step skipped on an inf — so
it is bitwise the plain loop too (:func:`step_rules`).

*A non-finite total norm* (an inf or a NaN gradient, no scaler) holds the step, in a
loop that calls ``step()``: nothing is clipped or stepped in backward, and the backward
counts as one that stepped nothing (:attr:`GlobalStep.held`). The loop then does what
the plain loop does with those gradients: ``clip_grad_norm_(..., error_if_nonfinite=True)``
raises before anything changed, a loop that checks ``torch.isfinite(norm)`` skips the
step with ``zero_grad()``, and a ``step()`` takes the full step (clipped by the NaN
norm, as the plain one). Checking the norm reads one value back to the host at the end
of backward (a GPU sync per step, with ``clip_grad_norm=`` only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.core.engine import OverlapEngine
from overlapkit.overlap.rules.clip_halves import (
    unguarded_clip_grads_with_norm_,
    unguarded_get_total_norm,
)
from overlapkit.overlap.rules.clipping import GradClipping
from overlapkit.overlap.rules.late_clipping import unguarded_clip_grad_value_

__all__ = ["GlobalStep", "check_grad_scaler", "model_order", "step_rules"]


def check_grad_scaler(grad_scaler: Any) -> None:
    """:raises ConfigurationError: ``grad_scaler`` is not a ``torch.amp.GradScaler``."""
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise ConfigurationError(
            f"grad_scaler must be a torch.amp.GradScaler (or None), got "
            f"{type(grad_scaler).__name__}; pass the scaler your loop calls "
            "scaler.scale(loss), scaler.step(opt) and scaler.update() on."
        )


def model_order(params: Iterable[torch.Tensor]) -> dict[int, int]:
    """``id(param)`` -> its position in ``params`` (pass ``model.parameters()``): the
    order global clipping computes the total norm in."""
    return {id(param): index for index, param in enumerate(params)}


def step_rules(clipping: GradClipping, grad_scaler: Any | None, *, sharded: bool = False,
               order: Mapping[int, int] | None = None
               ) -> tuple[GlobalStep | None, GlobalStep | None]:
    """What a stepper applies at the end of backward and in a full step.

    :return: ``(global_step, full_step)``: the :class:`GlobalStep` the steps of a
        backward wait for (None when they step part by part as gradients arrive), and
        the one a ``step()`` with no stepping backward since the previous applies (None
        when it is the optimizer's plain ``step()``: nothing to clip or unscale). A full
        step has no parts, so ``clip_grad_norm_scope="bucket"`` clips it by the global
        norm.
    """
    full = None
    if clipping.enabled or grad_scaler is not None:
        full = GlobalStep(attrs.evolve(clipping, scope="global"), grad_scaler,
                          sharded=sharded, order=order)
    if not GlobalStep.needed(clipping, grad_scaler):
        return None, full
    return GlobalStep(clipping, grad_scaler, sharded=sharded, order=order), full


class GlobalStep:
    """Unscale, check, clip and step every owned parameter at the end of backward.

    :param clipping: the clipping options (norm clipping here is global).
    :param grad_scaler: the ``torch.amp.GradScaler`` whose scaled loss the backward
        ran on, or None.
    :param sharded: the gradients are shards (FSDP2): an inf in one rank's shard
        must skip the step on every rank, so the inf check is summed over the ranks
        (what ``ShardedGradScaler.unscale_`` does); under DDP the allreduce already
        put the inf in every rank's gradient.
    :param order: :func:`model_order` of the model: the order gradients are clipped
        in (default: the optimizer's parameter order).
    """

    def __init__(self, clipping: GradClipping, grad_scaler: Any | None,
                 sharded: bool = False, order: Mapping[int, int] | None = None) -> None:
        self.clipping = clipping
        self.grad_scaler = grad_scaler
        self.sharded = sharded
        self.order = order
        #: per device, whether the last backward's gradients held an inf or a nan
        #: (what ``GradScaler.update()`` reads); empty without a scaler
        self.found_inf_per_device: dict[torch.device, torch.Tensor] = {}
        #: the total norm the last :meth:`step` clipped with (what torch's
        #: ``clip_grad_norm_`` returned), and the parameters it clipped; read by
        #: :mod:`~overlapkit.overlap.rules.late_clipping` to answer the same clip asked after
        #: backward. None / empty when it clipped nothing by norm.
        self.last_norm: torch.Tensor | None = None
        self.last_clipped: list[torch.Tensor] = []
        #: the last :meth:`step` held its step: the total norm was not finite
        self.held = False

    @staticmethod
    def needed(clipping: GradClipping, grad_scaler: Any | None) -> bool:
        """Whether steps must wait for the end of backward."""
        return grad_scaler is not None or (
            clipping.norm is not None and clipping.scope == "global")

    def step(self, engine: OverlapEngine, params: Sequence[torch.Tensor], *,
             hold_nonfinite: bool = False) -> bool:
        """Unscale and check (with a scaler), clip, then step ``params`` that have a
        gradient, in the model's parameter order; returns whether it stepped.

        ``hold_nonfinite``: a total norm that is not finite (no scaler, no value clip)
        leaves every gradient as it is and steps nothing, with :attr:`held` set (see the
        module docstring)."""
        order = self.order
        if order is None:
            order = model_order(engine.parameters())
        with_grad = sorted((p for p in params if p.grad is not None),
                           key=lambda p: order.get(id(p), len(order)))
        self.found_inf_per_device = {}  # no gradient: no inf check, as GradScaler
        self.last_norm, self.last_clipped = None, []
        self.held = False
        if not with_grad and not self.sharded:
            return False
        found_inf = self._unscale(engine.optimizer)
        if not with_grad:
            return False
        with torch.no_grad():
            if self.clipping.value is not None:
                unguarded_clip_grad_value_(with_grad, self.clipping.value)
            if self.clipping.norm is not None:
                # torch's clip_grad_norm_, in its two halves (the same calls)
                norm = unguarded_get_total_norm([p.grad for p in with_grad],  # type: ignore[misc]
                                                self.clipping.norm_type, False, None)
                if (hold_nonfinite and self.grad_scaler is None and not self.sharded
                        and self.clipping.value is None and not bool(torch.isfinite(norm))):
                    self.held = True
                    return False
                unguarded_clip_grads_with_norm_(with_grad, self.clipping.norm, norm, None)
                self.last_norm = norm
                self.last_clipped = with_grad
        if found_inf:
            return False  # GradScaler.step skips the whole step
        engine.step_params(with_grad)
        return True

    def _unscale(self, optimizer: torch.optim.Optimizer) -> bool:
        """``GradScaler.unscale_``'s arithmetic on the optimizer's gradients (its own
        ``_unscale_grads_``, with the scale the loss was scaled by); whether an inf or
        nan was found."""
        scaler = self.grad_scaler
        self.found_inf_per_device = {}
        if scaler is None or not scaler.is_enabled():
            return False
        scale = scaler._scale  # set by scaler.scale(loss), before this backward
        if scale is None:
            return False
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        per_device = scaler._unscale_grads_(optimizer, inv_scale, found_inf, False)
        if self.sharded:
            # every rank calls this once per backward (FSDP2 gives each a shard of
            # every gradient): one summed flag, on the scale's device
            total = torch.zeros((), dtype=torch.float32, device=scale.device)
            for value in per_device.values():
                total += value.to(scale.device)
            dist.all_reduce(total)
            per_device = {scale.device: total}
        self.found_inf_per_device = per_device
        return bool(sum(v.item() for v in self.found_inf_per_device.values()))
