"""The Lion optimizer (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms").

Lion keeps one momentum buffer and steps by the *sign* of an interpolation between the
momentum and the gradient, so every coordinate moves by exactly ``lr``::

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

:func:`lion_update` is the whole update for a list of parameters; the optimizer and
the overlapped bucket step both call it, which is why they agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["Lion", "lion_update", "lion_update_flat"]


def lion_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    foreach: bool,
) -> None:
    """Apply one Lion step to ``params`` in place (and update ``exp_avgs``).

    With ``foreach`` the step is a handful of multi-tensor kernels for the whole list
    instead of a handful per parameter. Every product is rounded on its own (no
    ``add_(x, alpha=...)``, which CPU kernels may fuse into a multiply-add in their
    vector path and not in their scalar tail), so the per-parameter, foreach and
    flat-buffer (:func:`lion_update_flat`) forms give the same bits.
    """
    if not params:
        return
    if foreach:
        if weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        update = torch._foreach_mul(exp_avgs, beta1)
        torch._foreach_add_(update, torch._foreach_mul(grads, 1 - beta1))
        torch._foreach_sign_(update)
        torch._foreach_mul_(update, lr)
        torch._foreach_sub_(params, update)
        torch._foreach_mul_(exp_avgs, beta2)
        torch._foreach_add_(exp_avgs, torch._foreach_mul(grads, 1 - beta2))
        return
    for param, grad, exp_avg in zip(params, grads, exp_avgs, strict=True):
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        update = exp_avg.mul(beta1).add_(grad.mul(1 - beta1)).sign_().mul_(lr)
        param.sub_(update)
        exp_avg.mul_(beta2).add_(grad.mul(1 - beta2))


def lion_update_flat(
    params: list[Tensor],
    flat_grad: Tensor,
    flat_exp_avg: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    scratch: Tensor | None = None,
) -> None:
    """:func:`lion_update` for parameters whose gradients and momenta are each laid
    out back to back in one flat buffer (a DDP gradient bucket): the momentum
    arithmetic runs as single kernels over the buffer, and only the parameter update
    touches the parameters one by one.

    :param scratch: at least ``2 * flat_grad.numel()`` elements to compute in, kept
        by the caller between calls: fresh multi-megabyte temporaries each step cost
        page faults that made this slower than the per-tensor form for large buckets.
    """
    count = flat_grad.numel()
    if scratch is None:
        scratch = torch.empty(2 * count, dtype=flat_grad.dtype, device=flat_grad.device)
    update, scaled_grad = scratch[:count], scratch[count:2 * count]
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch.mul(flat_exp_avg, beta1, out=update)
    torch.mul(flat_grad, 1 - beta1, out=scaled_grad)
    update.add_(scaled_grad).sign_().mul_(lr)
    sizes = [p.numel() for p in params]
    torch._foreach_sub_(params, [u.view_as(p) for u, p in
                                 zip(update.split(sizes), params, strict=True)])
    torch.mul(flat_grad, 1 - beta2, out=scaled_grad)
    flat_exp_avg.mul_(beta2).add_(scaled_grad)


class Lion(torch.optim.Optimizer):
    """Lion: sign of an interpolated momentum, one state buffer per parameter.

    :param lr: step size; Lion wants a 3-10x smaller ``lr`` than AdamW.
    :param betas: ``(beta1, beta2)``: interpolation for the update, decay of the momentum.
    :param weight_decay: decoupled weight decay, as AdamW's.
    :param foreach: use multi-tensor kernels (default: on).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        foreach: bool = True,
    ) -> None:
        if not lr > 0.0:
            raise ValueError(f"Lion needs lr > 0, got {lr}; Lion's usual lr is 1e-4 to 3e-4.")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion needs 0 <= beta < 1 for both betas, got {betas}.")
        if weight_decay < 0.0:
            raise ValueError(f"Lion needs weight_decay >= 0, got {weight_decay}.")
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "foreach": foreach}
        super().__init__(params, defaults)

    def group_tensors(self, group: dict[str, Any], params: Iterable[Tensor]
                      ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """The params with a gradient among ``params``, their grads and momenta
        (created as zeros on first use)."""
        with_grad, grads, exp_avgs = [], [], []
        for param in params:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise RuntimeError("Lion does not support sparse gradients.")
            state = self.state[param]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            with_grad.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
        return with_grad, grads, exp_avgs

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one Lion step on every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs = self.group_tensors(group, group["params"])
            beta1, beta2 = group["betas"]
            lion_update(params, grads, exp_avgs, lr=group["lr"], beta1=beta1, beta2=beta2,
                        weight_decay=group["weight_decay"], foreach=group["foreach"])
        return loss
