"""Stepping a subset of an ``Adam``, ``AdamW`` or ``SGD`` optimizer's parameters
through torch's own implementation directly, instead of through ``step()``.

The generic engine steps one DDP bucket, a run of buckets or one parameter per call,
up to hundreds of times per training step. ``Adam.step()`` spends most of a small
subset's time around the arithmetic: torch's hook-and-profiler wrapper, grad-mode
switching, the capture health check, the loop over groups, ``_init_group`` (the
tensor lists, built parameter by parameter) and ``adam()``'s choice of implementation.
For the three most used optimizers this module runs the same loop body as their
``step()`` — ``_init_group`` (torch's own method: the lazy state initialisation and
the tensor lists), then the implementation ``step()`` would choose for the group
(``_single_tensor_adam`` / ``_multi_tensor_adam``, ``_single_tensor_sgd`` /
``_multi_tensor_sgd``) with its hyperparameters, then (SGD) the momentum buffers
written back into the state — so the kernels, the state and the result are those of
``step()``, bitwise. :class:`FunctionalSteps` keeps each subset's tensor lists and
checks them at the next step instead of calling ``_init_group`` again
(:mod:`overlapkit.overlap.core.tensor_lists`). Measured on torch 2.13, CPU, 1 rank, 400
one-parameter buckets (thread CPU time): 8 us less per bucket than the unwrapped
``step()`` of :mod:`overlapkit.overlap.core.direct_step`, before the lists were kept.

Only where that loop body *is* what ``step()`` would run: the exact torch class (a
subclass may override ``step``), the same conditions as
:func:`~overlapkit.overlap.core.direct_step.unwrapped_step` (no step hook, no profiler, no
``step`` patched on the instance), no ``GradScaler`` attributes (``grad_scale``,
``found_inf``), not compiling, and for each group: not ``differentiable``, not
``capturable``, not ``fused``, and no tensor ``lr`` with the multi-tensor
implementation (``foreach`` resolved as ``adam()`` / ``sgd()`` resolve it: the
single-tensor one on CPU by default, the multi-tensor one on CUDA). Otherwise, and on a
torch whose private functions have other signatures, the engine calls ``step()``.
"""


from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import torch
from torch.optim import adam as torch_adam
from torch.optim import optimizer as torch_optimizer
from torch.optim import sgd as torch_sgd

from overlapkit.overlap.core.direct_step import unwrapped_step
from overlapkit.overlap.core.engine import StepPlan
from overlapkit.overlap.core.tensor_lists import AdamLists, SgdLists, same_objects

__all__ = ["FUNCTIONAL_STEPS", "FunctionalSteps", "step_functionally"]

ParamGroup = dict[str, Any]
#: steps ``params`` of one live group of the optimizer: (optimizer, group, params,
#: multi-tensor or not, the kept tensor lists)
GroupStep = Callable[[Any, ParamGroup, list[torch.Tensor], bool, dict[int, Any]], None]
_Lists = TypeVar("_Lists", AdamLists, SgdLists)


def _kept(kept: dict[int, Any], params: list[torch.Tensor], kind: type[_Lists],
          optimizer: Any, group: ParamGroup) -> tuple[_Lists, list[torch.Tensor]] | None:
    """The lists kept for ``params`` and the gradients to step with, if they are still
    what ``_init_group`` would return; else None."""
    lists = kept.get(id(params))
    if not isinstance(lists, kind) or lists.params is not params:
        return None
    grads = lists.current_grads(optimizer, group)
    return None if grads is None else (lists, grads)


def _adam_group(optimizer: Any, group: ParamGroup, params: list[torch.Tensor],
                multi_tensor: bool, kept: dict[int, Any]) -> None:
    """``Adam.step``'s loop body (torch 2.13) for ``params`` of ``group``."""
    found = _kept(kept, params, AdamLists, optimizer, group)
    if found is None:
        lists, grads, keep = AdamLists.gather(optimizer, group, params)
        _keep(kept, params, lists if keep else None)
    else:
        lists, grads = found
    beta1, beta2 = group["betas"]
    implementation = torch_adam._multi_tensor_adam if multi_tensor \
        else torch_adam._single_tensor_adam
    implementation(
        lists.params, grads, lists.exp_avgs, lists.exp_avg_sqs, lists.max_exp_avg_sqs,
        lists.state_steps, None, None, amsgrad=group["amsgrad"],
        has_complex=lists.has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        capturable=False, differentiable=False,
        decoupled_weight_decay=group["decoupled_weight_decay"],
    )


def _sgd_group(optimizer: Any, group: ParamGroup, params: list[torch.Tensor],
               multi_tensor: bool, kept: dict[int, Any]) -> None:
    """``SGD.step``'s loop body (torch 2.13) for ``params`` of ``group``."""
    found = _kept(kept, params, SgdLists, optimizer, group)
    buffers: list[torch.Tensor | None]
    if found is not None:
        lists, grads = found
        stepped, buffers, has_sparse_grad = lists.params, list(lists.momentum_buffers), False
    else:
        subset = dict(group)
        subset["params"] = params
        stepped, grads, buffers = [], [], []
        has_sparse_grad = optimizer._init_group(subset, stepped, grads, buffers)
    implementation = torch_sgd._multi_tensor_sgd if multi_tensor \
        else torch_sgd._single_tensor_sgd
    implementation(
        stepped, grads, buffers, None, None,
        weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
        dampening=group["dampening"], nesterov=group["nesterov"],
        maximize=group["maximize"], has_sparse_grad=has_sparse_grad,
    )
    if found is not None and same_objects(buffers, found[0].momentum_buffers):
        return  # buffers updated in place: the state holds them already
    _keep(kept, params, SgdLists.written_back(optimizer, group, params, stepped, buffers,
                                              has_sparse_grad))


def _keep(kept: dict[int, Any], params: list[torch.Tensor], lists: Any) -> None:
    """Keep ``lists`` for ``params`` (None: forget them)."""
    if lists is None:
        kept.pop(id(params), None)
    else:
        kept[id(params)] = lists


#: the signatures the loop bodies above were written against (torch 2.13)
_EXPECTED_SIGNATURES: dict[Callable[..., Any], tuple[str, ...]] = {
    torch.optim.Adam._init_group: ("self", "group", "params_with_grad", "grads", "exp_avgs",
                                   "exp_avg_sqs", "max_exp_avg_sqs", "state_steps"),
    torch_adam._single_tensor_adam: (
        "params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps",
        "grad_scale", "found_inf", "amsgrad", "has_complex", "beta1", "beta2", "lr",
        "weight_decay", "eps", "maximize", "capturable", "differentiable",
        "decoupled_weight_decay"),
    torch_adam._multi_tensor_adam: (
        "params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps",
        "grad_scale", "found_inf", "amsgrad", "has_complex", "beta1", "beta2", "lr",
        "weight_decay", "eps", "maximize", "capturable", "differentiable",
        "decoupled_weight_decay"),
    torch.optim.SGD._init_group: ("self", "group", "params", "grads", "momentum_buffer_list"),
    torch_sgd._single_tensor_sgd: (
        "params", "grads", "momentum_buffer_list", "grad_scale", "found_inf",
        "weight_decay", "momentum", "lr", "dampening", "nesterov", "maximize",
        "has_sparse_grad"),
    torch_sgd._multi_tensor_sgd: (
        "params", "grads", "momentum_buffer_list", "grad_scale", "found_inf",
        "weight_decay", "momentum", "lr", "dampening", "nesterov", "maximize",
        "has_sparse_grad"),
}


def _signatures_match() -> bool:
    try:
        return all(tuple(inspect.signature(function).parameters) == names
                   for function, names in _EXPECTED_SIGNATURES.items())
    except (TypeError, ValueError):  # pragma: no cover - depends on torch
        return False


def _own_step(optim_cls: type[torch.optim.Optimizer]) -> Callable[..., Any]:
    """``optim_cls``'s ``step`` as its module defines it, inside torch's wrapper."""
    for cls in optim_cls.__mro__:
        step = cls.__dict__.get("step")
        if step is not None:
            return step.__wrapped__ if getattr(step, "hooked", False) else step
    raise AssertionError(f"{optim_cls} has no step")  # pragma: no cover


@attrs.frozen
class FunctionalStep:
    """How one optimizer class is stepped functionally.

    :param own_step: the class's ``step`` as torch defines it; anything else running
        as its ``step`` (a patched class) turns the functional path off.
    :param group_step: its loop body for one group.
    :param health_check: whether its ``step`` starts with the accelerator-graph
        capture check (Adam's does, SGD's does not).
    """

    own_step: Callable[..., Any]
    group_step: GroupStep
    health_check: bool


#: optimizer class (exactly) -> how to step it; empty on a torch these do not fit
FUNCTIONAL_STEPS: dict[type[torch.optim.Optimizer], FunctionalStep] = (
    {torch.optim.Adam: FunctionalStep(_own_step(torch.optim.Adam), _adam_group, True),
     torch.optim.AdamW: FunctionalStep(_own_step(torch.optim.AdamW), _adam_group, True),
     torch.optim.SGD: FunctionalStep(_own_step(torch.optim.SGD), _sgd_group, False)}
    if _signatures_match() else {}
)


def _multi_tensor(group: ParamGroup, params: list[torch.Tensor]) -> bool | None:
    """Whether ``adam()`` / ``sgd()`` would run the multi-tensor (True) or the
    single-tensor (False) implementation for this group's ``params`` that have a
    gradient; None where ``step()`` must run (fused, capturable, differentiable, or a
    tensor ``lr`` with ``foreach``, which ``step()`` refuses or steps aside from)."""
    if group["differentiable"] or group.get("capturable") or group["fused"]:
        return None
    foreach = group["foreach"]
    if foreach is None and group["fused"] is None:
        with_grad = [p for p in params if p.grad is not None]
        # torch's default is foreach only if *every* tensor is on a foreach device, and
        # those are accelerators: one CPU tensor decides (1 us less per call, measured)
        if with_grad and with_grad[0].device.type == "cpu":
            return False
        _, foreach = torch_optimizer._default_to_fused_or_foreach(with_grad, False,
                                                                  use_fused=False)
    if foreach and torch.is_tensor(group["lr"]):
        return None
    return bool(foreach)


def step_functionally(optimizer: torch.optim.Optimizer,
                      groups: Sequence[tuple[ParamGroup, list[torch.Tensor]]],
                      kept: dict[int, Any] | None = None) -> bool:
    """Step each ``(live group, its parameters to step)`` of ``groups`` as ``step()``
    would, through the implementation ``step()`` would choose; False, having changed
    nothing, where that is not what ``step()`` would run (see the module's docstring).

    :param kept: the tensor lists of the subsets stepped before, by ``id()`` of the
        subset's list (:class:`FunctionalSteps` keeps it); None keeps nothing.
    """
    functional = FUNCTIONAL_STEPS.get(type(optimizer))
    if functional is None or unwrapped_step(optimizer) is not functional.own_step:
        return False
    if optimizer.defaults.get("differentiable") or torch.compiler.is_compiling():
        return False
    attributes = optimizer.__dict__
    if attributes.get("grad_scale") is not None or attributes.get("found_inf") is not None:
        return False
    implementations = [_multi_tensor(group, params) for group, params in groups]
    if None in implementations:
        return False
    if functional.health_check:
        optimizer._accelerator_graph_capture_health_check()
    lists = {} if kept is None else kept
    grad_was_enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # what step() runs under (not differentiable)
    try:
        for (group, params), multi_tensor in zip(groups, implementations, strict=True):
            functional.group_step(optimizer, group, params, bool(multi_tensor), lists)
    finally:
        torch._C._set_grad_enabled(grad_was_enabled)
    return True


class FunctionalSteps:
    """:func:`step_functionally` for one optimizer, keeping each subset's tensor lists
    (:mod:`overlapkit.overlap.core.tensor_lists`) from one step to the next in the
    subset's :class:`~overlapkit.overlap.core.engine.StepPlan` (``kept``): they are
    freed with the plan, and a subset stepped once (a plan made for one call) keeps
    nothing past it.

    Not thread-safe by itself: the engine calls it with its lock held.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        #: the plans holding kept lists (weakly: a plan dropped frees its lists)
        self._plans: weakref.WeakSet[StepPlan] = weakref.WeakSet()

    def step(self, groups: Sequence[tuple[ParamGroup, list[torch.Tensor]]],
             plan: StepPlan | None = None) -> bool:
        """Step ``groups`` functionally (see :func:`step_functionally`), keeping their
        lists in ``plan`` where given; False, having changed nothing, where ``step()``
        must run."""
        if plan is None:
            return step_functionally(self.optimizer, groups)
        kept = plan.kept
        if not kept:
            self._plans.add(plan)
        return step_functionally(self.optimizer, groups, kept)

    def forget(self) -> None:
        """Drop every kept list (and the state tensors they hold): the engine's
        parameters or their groups changed, or its state was loaded."""
        for plan in list(self._plans):
            plan.kept.clear()
        self._plans.clear()
