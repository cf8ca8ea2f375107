"""The tensor lists an ``Adam``, ``AdamW`` or ``SGD`` step passes to torch's
implementation, worked out once per subset of parameters and checked, not rebuilt, at
each step.

``step()`` builds them through the optimizer's ``_init_group`` on every call: for each
parameter, its gradient, its state (looked up by the tensor, through Python's
``Tensor.__hash__``) and that state's tensors, with the lazy state initialisation and
the checks in between. The overlapped engine steps the same subsets (a DDP bucket, a
run of buckets, one parameter) step after step, so :class:`FunctionalSteps` keeps those
lists per subset after the first ``_init_group`` has made them, and at each later step
only checks, in C-level passes over the kept lists, that they are still what
``_init_group`` would return:

- every parameter still has a gradient, none of them sparse (the gradients themselves
  are read again at each step: they are new tensors after each backward unless DDP
  keeps them as views of its buckets);
- each parameter's state is still the same ``dict`` (not replaced by ``load_state_dict``,
  by ``del optimizer.state[p]`` or by assigning a new one), and holds the same tensors
  (``exp_avg``, ``exp_avg_sq``, ``step``, ``max_exp_avg_sq``; SGD's ``momentum_buffer``)
  — a user who swaps one between steps gets it stepped, as with ``step()``;
- the group options that decide which lists exist (``amsgrad``; SGD's momentum being
  zero or not) have not changed.

Anything else — a new parameter without state yet, a gradient gone — goes through
``_init_group`` again, so whatever it would do (initialise, raise) it does. The lists
live in the subset's step plan (``StepPlan.kept``) and are freed with it; a state
dropped by hand (``optimizer.state.clear()``) stays referenced by a kept plan until
that subset's next step or the engine's next ``reindex()`` (a ``load_state_dict``
through the engine), since nothing tells the engine before. Measured on torch 2.13,
CPU: see ``docs/benchmarks.md`` ("Tensor lists kept per layout").
"""

from __future__ import annotations

from functools import partial
from operator import attrgetter, is_, itemgetter, methodcaller
from typing import Any

import attrs
import torch

__all__ = ["AdamLists", "SgdLists", "same_objects"]

ParamGroup = dict[str, Any]

_GRAD = attrgetter("grad")
_IS_SPARSE = attrgetter("is_sparse")
_IS_NONE = partial(is_, None)
_EXP_AVG = itemgetter("exp_avg")
_EXP_AVG_SQ = itemgetter("exp_avg_sq")
_MAX_EXP_AVG_SQ = itemgetter("max_exp_avg_sq")
_STEP = itemgetter("step")
_MOMENTUM_BUFFER = methodcaller("get", "momentum_buffer")


def same_objects(values: Any, kept: list[Any]) -> bool:
    """Whether ``values`` (an iterable) are ``kept``, object for object."""
    return all(map(is_, values, kept))


def _current_grads(params: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The gradients of ``params``, or None if one is missing or sparse."""
    grads = list(map(_GRAD, params))
    if any(map(_IS_NONE, grads)) or any(map(_IS_SPARSE, grads)):
        return None
    return grads


@attrs.frozen(eq=False)
class AdamLists:
    """``Adam._init_group``'s lists for one subset of one group, every parameter with
    a gradient.

    :param params: the subset (the caller's list: its identity is the key).
    :param states: each parameter's state ``dict``.
    """

    params: list[torch.Tensor]
    states: list[dict[str, Any]]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    max_exp_avg_sqs: list[torch.Tensor]
    state_steps: list[torch.Tensor]
    has_complex: bool
    amsgrad: bool

    @classmethod
    def gather(cls, optimizer: Any, group: ParamGroup,
               params: list[torch.Tensor]) -> tuple[AdamLists, list[torch.Tensor], bool]:
        """The lists through ``_init_group`` (torch's own), the gradients, and whether
        they may be kept (every parameter of ``params`` has a gradient)."""
        subset = dict(group)
        subset["params"] = params
        with_grad: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        exp_avgs: list[torch.Tensor] = []
        exp_avg_sqs: list[torch.Tensor] = []
        max_exp_avg_sqs: list[torch.Tensor] = []
        state_steps: list[torch.Tensor] = []
        has_complex = optimizer._init_group(subset, with_grad, grads, exp_avgs, exp_avg_sqs,
                                            max_exp_avg_sqs, state_steps)
        if not all(map(torch.is_tensor, state_steps)):  # adam()'s check, as step() runs it
            raise RuntimeError("API has changed, `state_steps` argument must contain a list "
                               "of singleton tensors")
        complete = len(with_grad) == len(params)
        state = optimizer.state
        lists = cls(params=params if complete else with_grad,
                    states=[state[param] for param in with_grad] if complete else [],
                    exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                    max_exp_avg_sqs=max_exp_avg_sqs, state_steps=state_steps,
                    has_complex=bool(has_complex), amsgrad=bool(group["amsgrad"]))
        return lists, grads, complete

    def current_grads(self, optimizer: Any, group: ParamGroup) -> list[torch.Tensor] | None:
        """The gradients to step with, if these lists are still ``_init_group``'s; else
        None (gather them again)."""
        if bool(group["amsgrad"]) is not self.amsgrad:
            return None
        grads = _current_grads(self.params)
        if grads is None:
            return None
        states = self.states
        try:
            if not (same_objects(map(optimizer.state.get, self.params), states)
                    and same_objects(map(_EXP_AVG, states), self.exp_avgs)
                    and same_objects(map(_EXP_AVG_SQ, states), self.exp_avg_sqs)
                    and same_objects(map(_STEP, states), self.state_steps)
                    and (not self.amsgrad
                         or same_objects(map(_MAX_EXP_AVG_SQ, states), self.max_exp_avg_sqs))):
                return None
        except KeyError:  # a state entry was deleted
            return None
        return grads


@attrs.frozen(eq=False)
class SgdLists:
    """``SGD._init_group``'s lists for one subset of one group, every parameter with a
    gradient and, with momentum, a momentum buffer.

    :param params: the subset (the caller's list: its identity is the key).
    :param states: each parameter's state ``dict`` (empty without momentum).
    :param momentum_buffers: their ``momentum_buffer`` (empty without momentum).
    """

    params: list[torch.Tensor]
    states: list[dict[str, Any]]
    momentum_buffers: list[torch.Tensor]
    with_momentum: bool

    def current_grads(self, optimizer: Any, group: ParamGroup) -> list[torch.Tensor] | None:
        """The gradients to step with, if these lists are still ``_init_group``'s; else
        None (gather them again)."""
        if (group["momentum"] != 0) is not self.with_momentum:
            return None
        grads = _current_grads(self.params)
        if grads is None:
            return None
        if self.with_momentum and not (
                same_objects(map(optimizer.state.get, self.params), self.states)
                and same_objects(map(_MOMENTUM_BUFFER, self.states), self.momentum_buffers)):
            return None
        return grads

    @classmethod
    def written_back(cls, optimizer: Any, group: ParamGroup, params: list[torch.Tensor],
                     stepped: list[torch.Tensor], buffers: list[torch.Tensor | None],
                     has_sparse_grad: bool) -> SgdLists | None:
        """What ``SGD.step()`` does after its arithmetic — the (new) momentum buffers
        into the state — for the ``stepped`` parameters of ``params`` gathered by
        ``_init_group``; the lists to keep, or None where they may not be kept (a
        parameter without a gradient, a sparse gradient)."""
        with_momentum = group["momentum"] != 0
        states: list[dict[str, Any]] = []
        if with_momentum:
            state = optimizer.state
            for param, buffer in zip(stepped, buffers, strict=True):
                states.append(state[param])
                states[-1]["momentum_buffer"] = buffer
        kept_buffers = [buffer for buffer in buffers if buffer is not None]
        if len(stepped) != len(params) or has_sparse_grad \
                or (with_momentum and len(kept_buffers) != len(params)):
            return None
        return cls(params=params, states=states, with_momentum=with_momentum,
                   momentum_buffers=kept_buffers if with_momentum else [])
