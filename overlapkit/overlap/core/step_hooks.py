"""Step hooks are code around the step: while one is registered, steps are taken at
``step()``, in the plain order.

``optimizer.register_step_pre_hook(hook)`` (on the overlapped optimizer, which registers
it on the real one) and torch's global ``register_optimizer_step_pre_hook`` run their
hook when the loop calls ``step()``: between backward and the step, where a hook clips
(``clip_grad_norm_``), adds noise, or reads the gradients and the state the step is
about to use. A step taken during backward would come before it: the hook's clip would
be refused after that step, its reads would see the stepped state. Run instead around
each partial step inside backward (as before 0.4), a hook would run once per bucket,
on part of the parameters, in the middle of backward. ``register_step_post_hook`` and
torch's global ``register_optimizer_step_post_hook`` (an EMA of the parameters, a step
counter, a log of the update) likewise run once per step in the plain loop, after every
parameter has stepped; around each partial step they ran once per bucket or param group
(measured: a global post-hook counting steps counted 6 in 3 steps of a model with two
param groups, and read half-stepped parameters).

So :func:`follow_step_hooks` looks, each time a backward that would step starts (before
anything steps in it), whether such a hook is registered, and while one is, defers the
steps to ``step()`` as a learnt loop that uses the window does
(:mod:`~overlapkit.overlap.core.window`, ``plain_order``): the hooks then run once per
step where they run in the plain loop, and the run is the plain loop's, bitwise, with
one warning. Once none is left, the next backward steps again.

It applies from the first backward, and to a loop known to call ``step()``; not to a
loop that has stepped during backward without ever calling ``step()`` (backward only:
deferred, its steps would never come). overlapkit's own global pre-hook (the guard
against a plain optimizer stepping claimed parameters) reads nothing and does not
count; nor does torch's profiler step counter (``torch.profiler._optimizer_post_hook``,
registered for a Kineto daemon), which only numbers the trace's steps: it runs per
partial step, as it does for any optimizer stepped several times. With sharded state
the overlapped optimizer refuses hooks, and one on the real optimizer
(``opt.optimizer``) is a hook per share stepped, by choice: only global pre-hooks count
there (``StepAccount.step_hooks_are_the_loops``). A global post-hook is refused there,
as a backward that would step starts (nothing stepped in it): it runs on each rank's
share before the other ranks' updates arrive (an EMA of the parameters read the old
values of every parameter another rank owns), and not at all on a rank that owns
nothing (:func:`sharded_post_hook_refusal`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.core.direct_step import PASSING_PRE_HOOKS
from overlapkit.overlap.core.first_step import plain_order_warning
from overlapkit.overlap.core.window import FirstWindow

__all__ = ["follow_step_hooks", "registered_step_hooks", "sharded_post_hook_refusal",
           "sharded_step_hook_refusal"]


def registered_step_hooks(optimizer: torch.optim.Optimizer | None, *,
                          own: bool = True) -> str | None:
    """Where step hooks that run around the loop's ``step()`` are registered, in words, or
    None: on ``optimizer`` (pre or post; with ``own``), or torch's global pre- or
    post-hooks (not counting overlapkit's own guard against plain steps, which reads
    nothing, nor the profiler's step counter)."""
    if own and (getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(
            optimizer, "_optimizer_step_post_hooks", None)):
        return "on this optimizer (register_step_pre_hook / register_step_post_hook)"
    if any(hook not in PASSING_PRE_HOOKS for hook in _global_optimizer_pre_hooks.values()):
        return "for every optimizer (torch.optim.optimizer.register_optimizer_step_pre_hook)"
    if any(hook not in PASSING_POST_HOOKS for hook in _global_optimizer_post_hooks.values()):
        return "for every optimizer (torch.optim.optimizer.register_optimizer_step_post_hook)"
    return None


def _profiler_step_counter() -> set[Any]:
    """torch's profiler's global post-hook (``KinetoStepTracker``'s step counter), where
    this torch has it."""
    try:
        from torch.profiler import _optimizer_post_hook
    except ImportError:  # pragma: no cover - another torch
        return set()
    return {_optimizer_post_hook}


#: global step post-hooks that are not the loop's: they number the trace's steps only
PASSING_POST_HOOKS: set[Any] = _profiler_step_counter()


def sharded_post_hook_refusal(steps: Any) -> ConfigurationError | None:
    """The refusal of a backward that would step with sharded optimizer state
    (``steps.step_hooks_are_the_loops`` false) while a global step post-hook is
    registered (see the module docstring), else None."""
    if steps.step_hooks_are_the_loops or not any(
            hook not in PASSING_POST_HOOKS for hook in _global_optimizer_post_hooks.values()):
        return None
    return ConfigurationError(
        f"a step post-hook is registered for every optimizer (torch.optim.optimizer."
        f"register_optimizer_step_post_hook), and {steps.technique} with sharded "
        "optimizer state steps each rank's share only: the hook would run after this "
        "rank's share stepped, before the other ranks' updates arrive (an EMA would "
        "read their old values), and not at all on a rank owning nothing. Nothing was "
        "stepped in this backward. Do the hook's work in the loop after "
        "optimizer.step() (every parameter holds its update then, on every rank), or "
        "remove the hook.")


def sharded_step_hook_refusal(method: str) -> ConfigurationError:
    """The refusal of ``register_step_pre_hook`` / ``register_step_post_hook`` (``method``)
    on an optimizer with sharded state."""
    return ConfigurationError(
        f"{method} on a sharded optimizer: a plain optimizer runs step hooks once per "
        "step on every rank, but this one steps inside backward, each rank its own "
        "share, a few buckets at a time, so a hook would run a varying number of times "
        "per step, only on the ranks owning a parameter in those buckets (measured: 3 "
        "to 4 times in 3 steps, never on a rank owning nothing), and one that "
        "communicates would hang. Nothing was registered. Do that work in the loop "
        "after backward() or step() (every parameter holds its update then, on every "
        "rank); a hook per partial step of this rank's share goes on "
        "optimizer.optimizer (the real optimizer)."
    )


def follow_step_hooks(steps: Any) -> None:
    """At the start of a backward that would step (a
    :class:`~overlapkit.overlap.core.step_accounting.StepAccount`'s
    ``starting_backward``): defer its step to ``step()`` while a step hook is
    registered, or step during backward again once none is (see the module docstring).
    """
    where = registered_step_hooks(steps.settings_of, own=steps.step_hooks_are_the_loops)
    if steps.plain_for_step_hooks:
        if where is None:  # removed: overlapped again from this backward
            steps.plain_for_step_hooks = False
            steps.first_window = None
            steps.deferring = False
        return
    if steps.deferring or steps.first_window is not None:
        return  # deferred already (learn_first_step, defer_steps())
    if where is None or (steps.has_stepped and not steps.calls_step):
        return  # none; or a backward-only loop, whose step() never comes
    steps.first_window = FirstWindow(optimizer=steps.settings_of, plain_order=True,
                                     learned=True)
    steps.deferring = steps.plain_for_step_hooks = True
    if not steps.warned_step_hooks:
        steps.warned_step_hooks = True
        warnings.warn(plain_order_warning(
            steps.technique, f"a step hook registered {where} runs around") +
            " Steps are taken during backward again once no step hook is registered; "
            "to keep the overlap, do the hook's work in the loop after optimizer.step().",
            UserWarning, stacklevel=2)
