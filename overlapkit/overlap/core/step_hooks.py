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

A subclass of an optimizer overriding its ``step()`` (a step counter, noise added after
``super().step()``) is code around the step too, which the engine would run once per
part stepped, on part of the parameters (measured: a counting override counted 9 in 3
steps of a plain module; noise added after the update 0.013 off the plain loop): it
counts as a step hook once the loop is known to call ``step()`` (any ``step()`` seen:
a learnt first step, Lightning's probe, a plain order). In a loop not known yet (no
``learn_first_step``), its first backward steps as usual and the ``step()`` after it is
refused (:func:`override_refusal`), naming ``learn_first_step``; a backward-only loop
(no ``step()`` at all) runs it per part, by design (:func:`step_override`). A ``step``
patched on the instance (``optimizer.step = wrapper``) counts as such an override
(:func:`instance_override`); torch's LR-scheduler wrapper, which only notes the call,
does not.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from overlapkit.errors import ConfigurationError, UnsupportedOptimizerError
from overlapkit.overlap.core.direct_step import PASSING_PRE_HOOKS
from overlapkit.overlap.core.first_step import plain_order_warning
from overlapkit.overlap.core.groups_behind import groups_changed_refusal
from overlapkit.overlap.core.step_patches import PER_PART_MARK, instance_override
from overlapkit.overlap.core.window import FirstWindow

__all__ = ["PER_PART_MARK", "backward_refusal", "follow_step_hooks",
           "hooks_without_step_refusal", "instance_override", "late_hook_refusal",
           "override_refusal", "override_warning", "sharded_override_refusal",
           "sharded_patch_refusal",
           "registered_step_hooks", "sharded_post_hook_refusal", "sharded_step_hook_refusal",
           "step_called", "step_override"]

#: the step accounts whose loop has called ``step()``: an override is then honoured as a
#: hook is (:func:`follow_step_hooks`)
_STEP_SEEN: weakref.WeakSet[Any] = weakref.WeakSet()
#: step account -> where the step hook is registered that deferred its first backward
#: before the loop called ``step()`` (:func:`hooks_without_step_refusal`)
_HOOK_DEFERRED: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
#: step account -> the refusal of its next ``step()``: its first backward, in a loop not
#: known yet to call ``step()``, ran an override per part (:func:`override_refusal`)
_OVERRIDE_REFUSALS: weakref.WeakKeyDictionary[Any, ConfigurationError] = (
    weakref.WeakKeyDictionary())


def step_called(steps: Any, stepped: bool) -> None:
    """The overlapped optimizer's ``step()``, once its step accounting has counted it
    (``stepped``: a backward stepped since the last one): the loop calls ``step()``.

    :raises ConfigurationError: :func:`override_refusal`, where that backward ran the
        optimizer's override of ``step()`` per part; :func:`late_hook_refusal`, where a
        step hook was registered after it started.
    """
    _STEP_SEEN.add(steps)
    refusal = _OVERRIDE_REFUSALS.get(steps)
    if stepped and refusal is not None:
        raise refusal
    if stepped and not steps.plain_for_step_hooks:
        where = registered_step_hooks(steps.settings_of, own=steps.step_hooks_are_the_loops)
        if where is not None:
            raise late_hook_refusal(steps.technique, where)


def late_hook_refusal(technique: str, where: str) -> ConfigurationError:
    """The refusal of a ``step()`` after a backward that stepped with no step hook
    registered as it started, one registered since (between that backward and this
    ``step()``, or a step of a backward-only loop): the plain ``step()`` runs the hook
    around this step, which was taken during backward without it (before: a halving
    pre-hook registered there was missing from that step, 0.004 off the plain SGD loop
    after 4 steps, with a warning saying the run was the plain loop's)."""
    return ConfigurationError(
        f"a step hook was registered {where} between backward() and optimizer.step(): "
        f"{technique} had already taken this step during backward, without the hook, "
        "where the plain step() runs it around this step. The parameters have taken it: "
        "restart from the last checkpoint after fixing the loop. Register step hooks "
        "before the backward (the steps are then taken at optimizer.step(), around the "
        "hook, in the plain order, bitwise the plain loop), or do the hook's work in the "
        "loop after optimizer.step().")


def backward_refusal(steps: Any) -> ConfigurationError | None:
    """The refusal of a backward that would step, as it starts (nothing stepped in it):
    :func:`sharded_post_hook_refusal`, :func:`hooks_without_step_refusal`, or parameters
    added to the real optimizer behind the overlapped one
    (:func:`~overlapkit.overlap.core.groups_behind.groups_changed_refusal`); else None."""
    return (sharded_post_hook_refusal(steps) or sharded_patch_refusal(steps)
            or hooks_without_step_refusal(steps) or groups_changed_refusal(steps))


def hooks_without_step_refusal(steps: Any) -> ConfigurationError | None:
    """The refusal of a backward that follows one deferred to ``step()`` for a step hook
    registered before the loop's first backward (:func:`follow_step_hooks`), where the
    loop has not called ``step()`` since: a backward-only loop (no ``step()`` at all)
    would never step, its gradients summed backward after backward (measured before this
    check: no parameter changed in 3 backwards, silently). Else None."""
    if steps not in _HOOK_DEFERRED or steps in _STEP_SEEN or not steps.plain_for_step_hooks:
        return None
    return ConfigurationError(
        f"a step hook is registered {_HOOK_DEFERRED[steps]}, so {steps.technique} takes "
        "every step at optimizer.step(), where the hook runs, and this loop ran another "
        "backward before its first step(): a loop that never calls step() would never "
        "step. Nothing was stepped in this backward. Call optimizer.step() after each "
        "backward (accumulate inside no_step() / the DDP model's no_sync()); in a loop "
        "without step(), register the hook after the first backward (it then runs around "
        "each part stepped), or do its work in the loop.")


def step_override(optimizer: torch.optim.Optimizer | type | None) -> str | None:
    """``"Noisy.step() overrides Adam.step()"`` where the class of ``optimizer`` overrides
    the ``step()`` of a concrete optimizer class it derives from, outside torch (a user's
    subclass of ``AdamW``); None for torch's own classes and for an optimizer defining
    the only ``step()`` of its line (a third-party optimizer, stepped part by part as
    any). torch's hook wrapper (``hooked``, set on the class of each optimizer built)
    is seen through. A ``step`` set on the instance is one too
    (:func:`instance_override`). ``optimizer`` may be the class itself."""
    if optimizer is None:
        return None
    patch = None if isinstance(optimizer, type) else instance_override(optimizer)
    return patch or _class_override(
        optimizer if isinstance(optimizer, type) else type(optimizer))


@functools.lru_cache(maxsize=64)
def _class_override(cls: type) -> str | None:
    """:func:`step_override` of a class, worked out once (asked at every stepping
    backward; torch patches a class's ``step`` as its first optimizer is built, before)."""
    found: list[tuple[type, Any]] = []  # (class, its step unwrapped), distinct steps
    for klass in cls.__mro__:
        if klass in (torch.optim.Optimizer, object) or "step" not in vars(klass):
            continue
        function = inspect.unwrap(vars(klass)["step"])
        if not any(function is seen for _, seen in found):
            found.append((klass, function))
    if len(found) < 2 or str(getattr(found[0][1], "__module__", "")).startswith("torch."):
        return None
    names = [getattr(function, "__qualname__", klass.__qualname__) for klass, function in found]
    return f"{names[0]}() overrides {names[1]}()"


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


def sharded_patch_refusal(steps: Any) -> ConfigurationError | None:
    """The refusal of a backward that would step with sharded optimizer state while the
    real optimizer's ``step`` is patched on the instance (:func:`instance_override`: a
    patch set after set-up, which refuses one: :func:`sharded_override_refusal`), else
    None."""
    if steps.step_hooks_are_the_loops or steps.settings_of is None:
        return None
    override = instance_override(steps.settings_of)
    return None if override is None else ConfigurationError(_sharded_override_text(
        override, "Nothing was stepped in this backward. "))


def sharded_override_refusal(override: str) -> UnsupportedOptimizerError:
    """The set-up's refusal of an optimizer whose ``step()`` is overridden
    (``override``, from :func:`step_override`) with sharded optimizer state."""
    return UnsupportedOptimizerError(_sharded_override_text(override, ""))


def _sharded_override_text(override: str, done: str) -> str:
    return (f"{override}, and with shard_optimizer_state=True each rank steps only its "
            "share of the parameters, part by part during backward: the override would "
            "run on each part of each rank's share instead of once per step over every "
            f"parameter. {done}Use overlap_ddp without shard_optimizer_state (after "
            "opt.learn_first_step(model) it takes every step at step(), in the plain "
            "order), or do the override's work in the loop after optimizer.step().")


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
    override = step_override(steps.settings_of) if steps.step_hooks_are_the_loops else None
    if where is None and override is not None:
        if steps in _STEP_SEEN:  # a loop that calls step(): honoured as a hook is
            where = override
        elif not (steps.deferring or steps.first_window is not None or steps.has_stepped):
            # not known yet to call step(): its step() is refused
            _OVERRIDE_REFUSALS[steps] = override_refusal(steps.technique, override)
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
    if steps not in _STEP_SEEN and where is not override:
        _HOOK_DEFERRED[steps] = where  # a second backward before step() is refused
    if not steps.warned_step_hooks:
        steps.warned_step_hooks = True
        if where is override:
            warnings.warn(override_warning(steps.technique, override), UserWarning,
                          stacklevel=2)
            return
        warnings.warn(plain_order_warning(
            steps.technique, f"a step hook registered {where} runs around") +
            " Steps are taken during backward again once no step hook is registered; "
            "to keep the overlap, do the hook's work in the loop after optimizer.step().",
            UserWarning, stacklevel=2)


def override_warning(technique: str, override: str) -> str:
    """The one warning of a loop taking every step at ``step()`` because its optimizer's
    class overrides ``step()`` (:func:`step_override`)."""
    return (f"{technique} takes every step of this loop at optimizer.step(), in the plain "
            f"order, without overlap: {override}, and stepping during backward would run "
            "that override once per part stepped (a bucket, a parameter), on part of the "
            "parameters. The run is the plain loop's, bitwise. To keep the overlap, do the "
            "override's work in the loop after optimizer.step() and pass the class it "
            "derives from.")


def override_refusal(technique: str, override: str) -> ConfigurationError:
    """The refusal of the first ``step()`` of a loop not known to call it (no
    ``learn_first_step``) after a backward that ran the override per part
    (:func:`step_override`): the step it was meant for is taken."""
    return ConfigurationError(
        f"{override}, and {technique} stepped this loop's first backward during backward, "
        "running that override once per part stepped (a bucket, a parameter), on part of "
        "the parameters, where the plain loop runs it once per step(): that step differs "
        "from the plain one (restart from the last checkpoint). Call "
        "opt.learn_first_step(model) once before the loop: every step is then taken at "
        "step(), in the plain order, bitwise the plain loop (one warning); or do the "
        "override's work in the loop after optimizer.step() and pass the class it "
        "derives from, to keep the overlap.")
