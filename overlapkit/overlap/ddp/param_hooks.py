"""What the DDP techniques hook on the parameters of a DDP model, beside the comm hook:
the early freeing of local gradients (``optimizer_in_backward`` with
``gradient_as_bucket_view=False``), and the refusal of a parameter that was frozen when
DDP was built and has been unfrozen since (:class:`~overlapkit.overlap.ddp.bucket_stepper.
BucketStepper` runs it before each forward). Usage tracking
(``find_unused_parameters``) stays with the stepper, whose state it fills.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.weak import WeakIdKeyDictionary

from overlapkit.errors import ConfigurationError

__all__ = ["free_local_grads_once_bucketed", "refuse_unfrozen"]


def refuse_unfrozen(frozen: list[tuple[str, torch.Tensor]], technique: str) -> None:
    """:raises ConfigurationError: a parameter in ``frozen`` (frozen when DDP was built,
    so DDP never reduces it) has ``requires_grad=True`` now."""
    for name, param in frozen:
        if param.requires_grad:
            raise ConfigurationError(
                f"parameter {name!r} was frozen (requires_grad=False) when "
                "DistributedDataParallel was built and has been unfrozen since: DDP "
                "decides at construction which parameters it reduces, so it never "
                f"reduces this one's gradient and {technique} never steps it (the plain "
                "loop would step it on each rank's own gradient, and the replicas would "
                "drift apart). Nothing was changed. Unfreeze parameters before wrapping "
                "the model: build a new DistributedDataParallel after unfreezing and call "
                f"{technique} on it (load the optimizer's state_dict() into the new one)."
            )


# parameters whose AccumulateGrad node carries the freeing hook of an earlier set-up (a
# released optimizer, a DDP model dropped since: Lightning's tuner then fit). Python hooks
# on a node run together, at the place of the first one registered, so a hook added for
# a later DDP model would run before that model's reducer copies the gradient into its
# bucket: the reduced gradients were all zero (measured on torch 2.13, a second
# Lightning fit). Those parameters' local gradients are freed at their bucket's step.
_HOOKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _freeing(model: DistributedDataParallel) -> Any:
    """The stepper the model's comm hook runs now, when it frees the gradients (not
    once its optimizer was released: plain DDP's gradients from then on), else None."""
    stepper = getattr(getattr(model, "_overlapkit_comm_hook_slot", None), "stepper", None)
    return stepper if getattr(stepper, "free_grads", False) else None


def free_local_grads_once_bucketed(model: DistributedDataParallel,
                                   params: Iterable[torch.Tensor]) -> None:
    """With ``gradient_as_bucket_view=False``: set each parameter's local ``.grad``
    to None as soon as DDP has copied it into its bucket, instead of when the
    bucket is stepped, so at most one local gradient is alive at a time.

    A post hook on the parameter's ``AccumulateGrad`` node, registered after the
    one DDP's reducer registered when the model was built, runs right after that
    copy (post hooks run in registration order). Not in backwards DDP does not
    reduce (``no_sync()``: DDP copies nothing and the gradients accumulate), and
    not with ``static_graph`` (its first backward copies every gradient into the
    buckets only at the end).
    """

    # held weakly: the hook lives as long as the parameter, and a strong reference kept
    # a dropped DDP model alive with its buckets, its reducer and, through its comm hook,
    # its optimizer, whose claim then refused a new DDP model around the same module
    # (measured before: a ConfigurationError telling to release() an optimizer the loop
    # no longer holds; overlap_ddp, which hooks nothing here, passed)
    model_ref = weakref.ref(model)

    def make_hook(param: torch.Tensor) -> Any:
        def free_after_ddp_copied(grad_inputs: Any, grad_outputs: Any) -> None:
            model = model_ref()
            if model is None:
                return
            if model.require_forward_param_sync and not model.static_graph:
                stepper = _freeing(model)
                if stepper is not None:
                    param.grad = None
                    stepper.unreduced.freed(param)  # stepped once its bucket runs

        return free_after_ddp_copied

    for param in params:
        if param in _HOOKED:
            continue
        _HOOKED[param] = True
        # the node autograd accumulates into, the one DDP's reducer holds
        view_node = param.view_as(param).grad_fn
        assert view_node is not None  # DDP manages only parameters that need grad
        accumulator = view_node.next_functions[0][0]
        assert accumulator is not None
        accumulator.register_hook(make_hook(param))
