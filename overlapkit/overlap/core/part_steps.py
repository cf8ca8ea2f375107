"""Whether an optimizer's ``step()`` may be run one part of its parameters at a time:
:func:`check_steps_per_part`, tried at set-up on small twins of the parameters.

The generic engine (:mod:`overlapkit.overlap.core.generic`) steps a bucket, a batch or
one parameter per call, the ``param_groups`` swapped for copies holding that part only,
in the order the gradients are ready (backward's). torch's own optimizers step each
parameter from its own gradient and state, so the result is the plain ``step()``'s. A
class of the user's or a third party's need not: a ``step()`` that divides by a norm
over every gradient (LAMB's global clipping), counts its calls in an attribute, in
``self.defaults``, in its param groups or in ``self.state`` under a key of its own, sets
a per-layer LR from a parameter's index in the groups, draws noise in parameter order,
or an ``_init_group`` override doing any of these, each ran once per part, on the part.
Measured with ``cdd1705``: ``optimizer_in_backward`` on a plain 3-layer model, 3 steps,
0.0002 to 0.037 off the plain loop, silently (the engine batches parts of up to 4 MiB
on CPU, so a small model stepped in one part hid it).

So, once at set-up, for an optimizer that is not one of torch's own classes and whose
``step()`` is not overridden on a torch class (that one is taken at ``step()``, see
:func:`~overlapkit.overlap.core.step_hooks.step_override`): a deep copy of it over twins
of its parameters (the first 3 trainable ones of each group, each dimension at most 3,
the same dtype, on the CPU, a seeded gradient each; no state, no hooks) is stepped
twice with all of them at once, and another copy twice one parameter at a time in
reverse order, as the engine would (0.05 s for an ``AdamW`` subclass of 200
parameters, where twins of all of them took 6.6 s on a shared 2-core machine). A
difference in a parameter or its state refuses the optimizer before anything changes. A
copy that cannot be made or stepped that way (an attribute that does not deep-copy, a
CUDA-only setting) lets it through: its own errors come at the real step.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from overlapkit.errors import UnsupportedOptimizerError
from overlapkit.overlap.core.step_hooks import step_override

__all__ = ["check_steps_per_part"]

_STEPS = 2
_EDGE = 3
_PER_GROUP = 3


def _own_step(optimizer: torch.optim.Optimizer) -> Callable[[Any], Any]:
    """The class's ``step`` inside torch's hook-and-profiler wrapper (the twin's hooks
    must not run: they are the loop's)."""
    step = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) else step  # type: ignore[attr-defined]


def _twin(optimizer: torch.optim.Optimizer, twins: dict[int, torch.Tensor],
          sampled: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
    """A deep copy of ``optimizer`` (its attributes too: ``Optimizer.__getstate__``
    keeps only its groups, defaults and state) over copies of ``twins`` (by the id of
    the real parameter: any reference to a parameter is copied as its twin), each group
    holding the twins of its ``sampled`` parameters, without state or step hooks."""
    memo: dict[int, Any] = {
        key: torch.nn.Parameter(twin.detach().clone(), requires_grad=twin.requires_grad)
        for key, twin in twins.items()}
    for group, chosen in zip(optimizer.param_groups, sampled, strict=True):
        memo[id(group["params"])] = [memo[id(p)] for p in chosen]
    memo[id(optimizer.state)] = defaultdict(dict)
    for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                 "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                 "_optimizer_load_state_dict_pre_hooks",
                 "_optimizer_load_state_dict_post_hooks"):
        hooks = getattr(optimizer, name, None)
        if hooks is not None:
            memo[id(hooks)] = type(hooks)()
    twin = type(optimizer).__new__(type(optimizer))
    memo[id(optimizer)] = twin
    twin.__dict__.update(copy.deepcopy(optimizer.__dict__, memo))
    return twin


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _step_parts(optimizer: torch.optim.Optimizer, step: Callable[[Any], Any]) -> None:
    """One step, one parameter at a time in reverse order, as the generic engine steps a
    part: copies of the groups holding it, values ``step()`` wrote copied back."""
    live = optimizer.param_groups
    for group in reversed(live):
        for param in reversed(group["params"]):
            if param.grad is None:
                continue
            before = dict(group)
            before["params"] = [param]
            copy_ = dict(before)
            optimizer.param_groups = [copy_]
            try:
                step(optimizer)
            finally:
                optimizer.param_groups = live
            for key, value in copy_.items():
                if key != "params" and (key not in before or before[key] is not value):
                    group[key] = value


def _tensors(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """The parameters and their state tensors, named, in the groups' order."""
    out: list[tuple[str, torch.Tensor]] = []
    for index, param in enumerate(_params(optimizer)):
        out.append((f"twin {index}", param))
        for key, value in sorted(optimizer.state.get(param, {}).items(), key=str):
            if isinstance(value, torch.Tensor):
                out.append((f"twin {index}'s state {key!r}", value))
    return out


def _difference(optimizer: torch.optim.Optimizer) -> str | None:
    """What differs between ``optimizer`` stepped whole and part by part, on twins of
    the first ``_PER_GROUP`` trainable parameters of each group."""
    generator = torch.Generator().manual_seed(0)
    twins: dict[int, torch.Tensor] = {}
    for param in _params(optimizer):
        shape = tuple(min(size, _EDGE) for size in param.shape)
        twins.setdefault(id(param), torch.nn.Parameter(
            torch.randn(shape, generator=generator).to(param.dtype),
            requires_grad=param.requires_grad))
    sampled = [[p for p in group["params"] if p.requires_grad][:_PER_GROUP]
               for group in optimizer.param_groups]
    grads = {id(p): [torch.randn(twins[id(p)].shape, generator=generator).to(p.dtype)
                     for _ in range(_STEPS)] for chosen in sampled for p in chosen}
    step = _own_step(optimizer)
    whole, parts = _twin(optimizer, twins, sampled), _twin(optimizer, twins, sampled)
    reals = [p for chosen in sampled for p in chosen]
    for index in range(_STEPS):
        for twinned in (whole, parts):
            for real, stepped in zip(reals, _params(twinned), strict=True):
                stepped.grad = grads[id(real)][index].clone()
        with torch.no_grad():
            state = torch.random.get_rng_state()
            step(whole)
            torch.random.set_rng_state(state)
            _step_parts(parts, step)
            torch.random.set_rng_state(state)
    for (name, a), (_, b) in zip(_tensors(whole), _tensors(parts), strict=True):
        if a.shape != b.shape or not torch.equal(a, b):
            return name
    return None


def check_steps_per_part(optimizer: torch.optim.Optimizer) -> None:
    """Refuse ``optimizer`` where its ``step()`` run part by part gives other values
    than one ``step()`` over every parameter (see the module docstring). torch's own
    classes, a ``step`` overridden on one of them (taken at ``step()``) and anything
    that is not a ``torch.optim.Optimizer`` are not tried.

    :raises UnsupportedOptimizerError: naming the class and what differed.
    """
    cls = type(optimizer)
    if (not isinstance(optimizer, torch.optim.Optimizer)
            or cls.__module__.startswith("torch.")
            or step_override(optimizer) is not None):
        return
    try:
        differs = _difference(optimizer)
    except Exception:  # not decidable here: the real step will tell
        return
    if differs is None:
        return
    raise UnsupportedOptimizerError(
        f"{cls.__qualname__}.step() does not step each parameter on its own: run one "
        "part of the parameters at a time (a bucket, a batch, a parameter), as the "
        "overlapped optimizer runs it during backward, it gives other values than one "
        f"step() over every parameter ({differs} differed, two steps of small twin "
        "parameters at set-up). Its step reads across parameters or counts its calls "
        "(a norm over every gradient, a step counter on the optimizer, its param groups "
        "or under a key of self.state, an LR from a parameter's index, noise drawn in "
        "parameter order). Nothing was changed. Train it in the plain loop (without "
        "overlapkit), keep the counter per parameter (in self.state[p], as torch's "
        "optimizers do), or register an overlapkit.OverlapEngine plugin for the class "
        "that steps it its own way."
    )
