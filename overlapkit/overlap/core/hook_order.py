"""Keep overlapkit's post-accumulate-grad hooks the last of each parameter's.

Where a step runs from a parameter's post-accumulate-grad hook (``optimizer_in_backward``
on a plain module or an FSDP2 model), a hook the loop registers on the same parameter
after set-up — gradient noise, a per-parameter clip, a gradient logger — would run
after the step, on a gradient already stepped and freed (``param.grad`` None: a raw
``AttributeError`` from the loop's hook, or its edit silently lost). In the plain loop
every such hook runs before ``step()``, so it sees, and changes, the gradient the step
takes.

Autograd (``AccumulateGrad``) and FSDP2 (``foreach_reduce``) both call a parameter's
hooks in the order of its ``_post_accumulate_grad_hooks`` dict (an ``OrderedDict``,
measured on torch 2.13; autograd by the dict's storage, FSDP2 by ``.values()``).
:class:`OwnHooksLast` takes overlapkit's entry out and puts it back at the end of that
dict before each forward, so hooks registered later — at any time, mid-training
included — run before the step, on the same gradient as in the plain loop; the
overlap stays on. A hook reading *another* parameter's gradient is not covered: that
one may have been stepped already.
"""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["OwnHooksLast"]


class OwnHooksLast:
    """overlapkit's post-accumulate-grad hooks, kept last on their parameters."""

    def __init__(self) -> None:
        self._hooks: list[tuple[torch.Tensor, RemovableHandle]] = []

    def add(self, param: torch.Tensor, handle: RemovableHandle) -> None:
        """Track ``handle``, overlapkit's hook just registered on ``param``."""
        self._hooks.append((param, handle))

    def clear(self) -> None:
        self._hooks.clear()

    def keep_last(self) -> None:
        """Move each tracked hook behind any registered after it (a dict lookup per
        parameter when none was: about 0.1 µs each)."""
        for param, handle in self._hooks:
            hooks = param._post_accumulate_grad_hooks
            if hooks is not None and len(hooks) > 1 and handle.id in hooks \
                    and next(reversed(hooks)) != handle.id:
                # pop and insert again: autograd iterates the dict's own storage
                # (PyDict_Next), which OrderedDict.move_to_end leaves as it was
                hooks[handle.id] = hooks.pop(handle.id)
