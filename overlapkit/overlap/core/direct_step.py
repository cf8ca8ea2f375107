"""Calling a torch optimizer's ``step()`` without the wrapper around it, when that
wrapper has nothing to do.

``torch.optim.Optimizer.__init__`` wraps each optimizer class's ``step`` once
(``Optimizer.profile_hook_step``): the wrapper opens a profiler ``record_function``,
runs the global and per-optimizer step pre- and post-hooks, and calls a no-op the
profiler's Python tracer watches. The generic engine calls ``step()`` once per bucket
(or per parameter) stepped, so that wrapper is paid hundreds of times per training
step instead of once: measured on torch 2.13, CPU, it is 13 us of the 38 us an
``Adam.step()`` of one small parameter takes (and more when the call sits between
backward kernels, whose code evicts it from the CPU's caches). With no hook
registered and no profiler running it does nothing but cost, so the class's own
``step`` (what the wrapper would call, with the same ``self``) is called directly.
Anything else — a hook, a running profiler, a ``step`` set on the instance (an LR
scheduler built on the real optimizer patches it there) — takes the full
``optimizer.step()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ["PASSING_PRE_HOOKS", "step_optimizer", "unwrapped_step"]

#: global step pre-hooks that pass every engine's real optimizer, so need not run for
#: it (overlapkit's plain-step guard, :mod:`overlapkit.overlap.plain_step_guard`)
PASSING_PRE_HOOKS: set[Callable[..., Any]] = set()


def unwrapped_step(
    optimizer: torch.optim.Optimizer,
) -> Callable[[torch.optim.Optimizer], Any] | None:
    """The function ``optimizer.step()`` would run inside torch's hook-and-profiler
    wrapper, when calling it directly changes nothing observable; otherwise None.

    Checked at each call (a few attribute reads): hooks and the profiler come and go.
    """
    if "step" in optimizer.__dict__:
        return None  # patched on the instance: whatever the patch does must run
    wrapper = type(optimizer).step
    if not getattr(wrapper, "hooked", False):
        return None  # not torch's wrapper (a class patched after its first instance)
    inner = getattr(wrapper, "__wrapped__", None)
    if inner is None:
        return None
    pre_hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    post_hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)
    if (pre_hooks is None or post_hooks is None or pre_hooks or post_hooks
            or any(hook not in PASSING_PRE_HOOKS
                   for hook in torch_optimizer._global_optimizer_pre_hooks.values())
            or torch_optimizer._global_optimizer_post_hooks):
        return None
    if torch._C._autograd._profiler_enabled():
        return None  # the step must show up in the trace as torch's own does
    return inner


def step_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``, without torch's wrapper where :func:`unwrapped_step`
    says that is the same."""
    inner = unwrapped_step(optimizer)
    if inner is None:
        optimizer.step()
    else:
        inner(optimizer)
