"""Which backward a step hook runs in: :class:`BackwardScope`.

A stepper's hooks (DDP's comm hook, a parameter's post-accumulate-grad hook) run inside
autograd's graph tasks. One ``loss.backward()`` is usually one graph task, but not
always: reentrant activation checkpointing (``torch.utils.checkpoint(...,
use_reentrant=True)``, the default of older Hugging Face ``gradient_checkpointing_enable``)
recomputes its segment and runs a *nested* ``torch.autograd.backward`` from inside the
outer backward — a separate graph task, with its own id and its own end. Counting each
task as a backward made 0.2 refuse a correct loop after some buckets had stepped.

Here a nested task belongs to the backward that encloses it: the backward starts at the
first hook of either kind of task and ends at the end of the outermost one. A task is
nested when the Python stack of the hook holds a call of autograd's
``_engine_run_backward`` made from inside an autograd Function's backward
(``BackwardCFunction.apply``): that is how a nested backward is started, on the thread
running the outer one (CPU) or on a device's autograd thread (the outer backward's
frames are then not on the stack, but the Function's are). The stack is read once per
graph task, never per hook.

When the first hook of a backward runs in a nested task, the outer task's end cannot be
queued from there (``queue_callback`` queues on the current task): a post hook is put on
the enclosing autograd node (the outer task's Function being run, typically
``CheckpointFunctionBackward``), which runs in the outer task once that node is done and
queues the end there (measured on torch 2.13: the callback then runs at the end of the
outer backward).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch.autograd import Variable

__all__ = ["CURRENT", "NEW", "OUTSIDE", "BackwardScope", "enclosing_node"]

#: :meth:`BackwardScope.enter` outside any backward (DDP's join shadow reductions, a
#: hook called by hand)
OUTSIDE = 0
#: inside the backward already under way
CURRENT = 1
#: the first hook of a new backward
NEW = 2

_ENGINE_RUN_BACKWARD = torch.autograd.graph._engine_run_backward.__code__
_FUNCTION_BACKWARD = torch.autograd.function.BackwardCFunction.apply.__code__


def enclosing_node() -> Any | None:
    """The autograd node of the outermost backward that the running backward is nested
    in, or None when it is not nested (see the module docstring)."""
    frame: FrameType | None = sys._getframe(1)
    after_backward_call = False
    node = None
    while frame is not None:
        code = frame.f_code
        if code is _ENGINE_RUN_BACKWARD:
            after_backward_call = True
        elif after_backward_call and code is _FUNCTION_BACKWARD:
            node = frame.f_locals.get("self")  # the outermost one found wins
        frame = frame.f_back
    return node


class BackwardScope:
    """Tells a stepper's hooks whether they start a backward, and calls ``on_end`` at
    the end of the outermost graph task of that backward.

    A backward that raised before its end leaves its scope open; the next backward that
    is not nested starts a new one, so nothing stays stuck.

    :param on_end: run as an autograd final callback of the outermost task, once per
        backward (it may queue further callbacks).
    """

    def __init__(self, on_end: Callable[[], None]) -> None:
        self._on_end = on_end
        #: the graph task of the last hook (the common case: the same again)
        self._last_task = -1
        #: the graph tasks of the backward under way (the outer one and nested ones)
        self._tasks: set[int] = set()
        #: counts backwards, so that a post hook left on a node of an earlier backward
        #: (a graph kept with ``retain_graph=True``) ends nothing
        self._generation = 0
        #: a backward has started and its end has not run
        self.open = False
        #: a hook of the backward under way ran in a nested graph task (reentrant
        #: activation checkpointing), where one parameter can be accumulated once per
        #: nested backward
        self.nested = False
        #: the thread that ran the first hook of the backward under way
        self._thread = 0

    def enter(self) -> int:
        """Called by every hook: :data:`OUTSIDE`, :data:`CURRENT` or :data:`NEW` (the
        caller starts its backward; its end is queued)."""
        task = torch._C._current_graph_task_id()
        if task == self._last_task:
            return CURRENT if task != -1 else OUTSIDE
        if task == -1:
            return OUTSIDE
        self._last_task = task
        if task in self._tasks:
            return CURRENT
        node = enclosing_node()
        if node is not None and self.open:
            self._tasks.add(task)  # nested in the backward under way
            self.nested = True
            return CURRENT
        self._generation += 1
        self._tasks = {task}
        self.open = True
        self.nested = node is not None
        self._thread = threading.get_ident()
        if node is None:
            Variable._execution_engine.queue_callback(self._end)
        else:
            node.register_hook(self._end_after_node(self._generation))
        return NEW

    def close_if_stale(self) -> None:
        """Before a forward, outside any backward, on the thread that ran the last one:
        a backward that raised before its end left this scope open. Close it, so that
        the next backward starts a new one even where its first hook runs in a nested
        task (a model run wholly inside one reentrant checkpoint), which would
        otherwise be taken as part of the dead backward, and never end."""
        if (self.open and torch._C._current_graph_task_id() == -1
                and threading.get_ident() == self._thread):
            self.open = False
            self._tasks = set()
            self._last_task = -1

    def _end_after_node(self, generation: int) -> Callable[[Any, Any], None]:
        def queue_end_in_outer_task(grad_inputs: Any, grad_outputs: Any) -> None:
            if generation == self._generation and self.open:
                self._tasks.add(torch._C._current_graph_task_id())
                Variable._execution_engine.queue_callback(self._end)
        return queue_end_in_outer_task

    def _end(self) -> None:
        self.open = False
        self._tasks = set()
        self._last_task = -1
        self._on_end()
