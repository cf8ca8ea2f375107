"""One optimizer step per iteration of the user's loop, whatever shape the loop has.

An overlapped optimizer steps *during* backward, so each backward that reaches it (not
inside ``no_sync()`` / ``no_step()``) is one optimizer step. The loops people write
around such an optimizer come in three shapes, all trained exactly as the plain loop
(backward, ``step()``, ``zero_grad()`` each iteration):

- **backward only** — PyTorch's tutorial on fusing the step into backward, PyTorch's own
  tests of ``DDP._register_fused_optim`` and ``_apply_optimizer_in_backward``: the loop
  never calls ``step()``;
- **backward, then** ``lr_scheduler.step()`` — torchtune's recipes with
  ``optimizer_in_bwd=True``: no ``step()``, no ``zero_grad()``;
- **backward,** ``step()``, ``zero_grad()`` — torchtitan, every plain loop.

What must never pass silently is gradient accumulation written for a plain optimizer
— K backwards, then one ``step()`` — without ``no_sync()`` / ``no_step()``: the
overlapped optimizer takes K steps where the plain loop takes one (measured on 0.1:
Adam 0.033 off plain DDP after 4 backwards and 2 ``step()`` calls). A loop's shape is
known only from what it calls, so :class:`StepAccount` learns it:

- until the loop has called ``step()`` or ``zero_grad()`` right after a stepping
  backward, it may be a backward-only loop, and every backward steps. The first
  ``step()`` that ends a window of more than one stepping backward raises
  :func:`accumulation_error` (on every rank: every rank calls it after the same
  backwards) — the first accumulation window is where such a loop shows itself;
- once it has (``calls_step``), a second stepping backward before the next ``step()``
  or ``zero_grad()`` is refused before anything steps in it
  (:func:`backward_without_step_error`): nothing is stepped, every DDP bucket is still
  reduced (the ranks stay in step) and the error is raised when it ends, on every rank.

A ``step()`` or ``zero_grad()`` that does not follow a stepping backward (set-up code
creating optimizer state, a first ``zero_grad()`` before the loop) says nothing about
the loop. A ``zero_grad()`` after several stepping backwards (no ``step()``) is a
backward-only loop clearing gradients now and then, accepted — unless the loop has
called ``step()`` right after a stepping backward before: it then discards gradients
the step was taken with (a GAN's generator loss reaching the discriminator, a step
skipped on a bad loss): :func:`discarded_step_error` (the step is taken: never silently).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from overlapkit.errors import ConfigurationError, OverlapkitError
from overlapkit.overlap.core.eager_steps import follow_compile
from overlapkit.overlap.core.first_step import follow_kept_gradients
from overlapkit.overlap.core.foreign_loop import foreign_trainer_refusal
from overlapkit.overlap.core.state_order import PlainStateOrder
from overlapkit.overlap.core.step_hooks import backward_refusal, follow_step_hooks
from overlapkit.overlap.core.watched_params import finish_after_step
from overlapkit.overlap.core.window import FirstWindow

if TYPE_CHECKING:
    from overlapkit.overlap.core.engine import OverlapEngine

#: the order of backwards that freed what they stepped, across optimizers (the last one
#: is the one a clip of an empty list stands for: ``rules/clip_halves.py``)
_FREEING = itertools.count(1)

__all__ = ["StepAccount", "accumulation_error", "backward_without_step_error",
           "discarded_step_error", "step_again_error"]


def backward_without_step_error(technique: str, accumulate: str) -> ConfigurationError:
    """The error of a stepping backward that follows another with no ``step()`` or
    ``zero_grad()`` between them, in a loop that calls them.

    :param technique: ``"overlap_ddp"`` or ``"optimizer_in_backward"``.
    :param accumulate: how to accumulate with this model, e.g.
        ``"with ddp_model.no_sync():"``.
    """
    return ConfigurationError(
        "backward() ran again before optimizer.step() or zero_grad() was called for the "
        f"previous backward, which already stepped the parameters: {technique} steps during "
        "backward, so every backward is one optimizer step, and this loop calls step() "
        "after its backwards, where a second backward would be a step the plain loop "
        "never takes. Nothing was stepped in this backward. To accumulate gradients over "
        f"several backwards, run all but the last {accumulate}; otherwise call step() (a "
        f"no-op) or zero_grad() of the optimizer {technique} returned after each backward."
    )


def accumulation_error(technique: str, accumulate: str, backwards: int) -> ConfigurationError:
    """The error of a ``step()`` that ends a window of ``backwards`` (> 1) stepping
    backwards: gradient accumulation written for a plain optimizer."""
    return ConfigurationError(
        f"optimizer.step() was called after {backwards} backwards that each stepped the "
        f"parameters: {technique} steps during backward, so this took {backwards} optimizer "
        "steps where the plain loop (gradient accumulation, then one step()) takes one. "
        f"To accumulate gradients over several backwards, run all but the last {accumulate} "
        "(they then step nothing, and the last backward steps the sum, exactly as the "
        "plain step() would). The parameters have already taken those steps: restart from "
        "the last checkpoint after fixing the loop."
    )


def discarded_step_error(technique: str) -> ConfigurationError:
    """The error of a ``zero_grad()`` that discards the gradients of a backward that
    stepped, in a loop that calls ``step()`` after its backwards: the plain loop takes
    no step with them (a second optimizer's loss reaching these parameters, as a GAN's
    generator loss reaches the discriminator; a step skipped on a bad loss)."""
    return ConfigurationError(
        "zero_grad() was called after a backward that stepped the parameters, with no "
        f"optimizer.step() between them, in a loop that calls step() after its "
        f"backwards: the plain loop discards these gradients, but {technique} steps "
        "during backward and took a step with them. The parameters have taken it: "
        "restart from the last checkpoint after fixing the loop. Keep a backward that "
        "must not step these parameters from reaching them (requires_grad_(False) on "
        "them during it, as Lightning's toggle_optimizer does; .detach() the input that "
        "leads to them), or decide before backward() whether to step."
    )


def skipped_on_freed_norm_error(technique: str) -> ConfigurationError:
    """The error of a ``zero_grad()`` with no ``step()`` after the loop read the norm of
    gradients ``technique`` had freed (NaN, with a ``FreedGradientNormWarning``): a loop
    that skips the step on a non-finite norm would skip every step, where each backward
    had already stepped."""
    return ConfigurationError(
        "zero_grad() was called with no optimizer.step() after the loop read the norm of "
        f"gradients that {technique} had stepped and freed during backward (NaN, with a "
        "FreedGradientNormWarning): a loop that skips the step on a non-finite norm "
        "skips nothing here, the backward had already stepped. The parameters have taken "
        "it: restart from the last checkpoint after passing clip_grad_norm= (math.inf "
        f"to leave the gradients unclipped) to {technique} and reading the norm with "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), that max_norm): it is the "
        "real norm, and a non-finite one holds the step for the loop to skip."
    )


def step_again_error(technique: str) -> ConfigurationError:
    """The error of a ``step()`` with no stepping backward since the last one, while
    the gradients the last backward stepped and freed would still be held by the plain
    loop (no ``zero_grad()`` since, none set again): the plain ``step()`` would step
    them again."""
    return ConfigurationError(
        "optimizer.step() was called again after the step of the last backward, with no "
        "zero_grad() in between: the plain step() would step that backward's gradients "
        f"again, but {technique} freed them once it had stepped them during backward. "
        "Nothing was stepped now. Call step() once per backward, and zero_grad() after "
        "it; to accumulate gradients over several backwards, run all but the last "
        "inside the technique's no_step() / the model's no_sync()."
    )


class StepAccount:
    """What a stepper counts of the backwards that stepped, for the optimizer it steps.

    The bucket and parameter steppers derive from it; the facade's ``step()`` and
    ``zero_grad()`` report to it (:meth:`step_called`, :meth:`zero_grad_called`).

    :param technique: the function that built it, for messages.
    :param accumulate: how to accumulate with this model, for messages.
    """

    #: a step hook on the real optimizer is the loop's (registered through the overlapped
    #: one), run around ``step()`` (:mod:`~overlapkit.overlap.core.step_hooks`); False
    #: where the overlapped optimizer refuses them (sharded state): one on the real
    #: optimizer is then a hook per part stepped, by choice
    step_hooks_are_the_loops = True
    #: what the step() ending a learnt first window kept (:func:`follow_kept_gradients`)
    kept_by_learning: list[tuple[torch.Tensor, Callable[[], Any]]] | None = None

    def __init__(self, technique: str, accumulate: str) -> None:
        self.technique = technique
        self.accumulate = accumulate
        #: a backward has stepped since the last ``step()``, which is then a no-op
        self.stepped_since_step = False
        #: stepping backwards since the last ``step()`` or ``zero_grad()``
        self.window = 0
        #: the loop has called ``step()`` or ``zero_grad()`` right after a stepping
        #: backward: from now on a second stepping backward in a window is refused
        self.calls_step = False
        #: any backward has stepped (read by LR schedulers through the facade, whose
        #: first ``scheduler.step()`` would warn that ``optimizer.step()`` never ran)
        self.has_stepped = False
        #: while true (the facade's ``defer_steps()``), backwards step nothing: their
        #: gradients are reduced as usual and kept, for a full step at ``step()``
        self.deferring = False
        #: asked first when a stepping backward starts: the error to refuse it with, or
        #: None; set by a framework that knows where its loop's backward runs
        #: (``OverlappedOptimizerFacade.gate_backwards``)
        self.backward_gate: Callable[[], OverlapkitError | None] | None = None
        #: what the loop does in its first optimizer step, while that step is deferred to
        #: learn it (``OverlappedOptimizerFacade.learn_first_step``, :mod:`.window`)
        self.first_window: FirstWindow | None = None
        #: the gradients a backward stepped, as it left them, in a loop that calls
        #: ``step()``: a change before ``step()`` could not reach that step
        #: (:meth:`stepped_backward_ended`, checked by the facade's ``step()``)
        self.stepped_marks: FirstWindow | None = None
        #: the real optimizer whose param-group settings (``lr``, ...) the loop may
        #: change between backward and ``step()``, or None (set by the facade)
        self.settings_of: torch.optim.Optimizer | None = None
        #: the loop has called ``step()`` (not only ``zero_grad()``) right after a
        #: stepping backward
        self.steps_after_backward = False
        #: ``zero_grad()`` was called after a stepping backward, before ``step()``
        self.zeroed_after_stepping = False
        #: the parameters whose gradients the last stepping backward freed once stepped,
        #: while neither ``zero_grad()`` nor a stepping backward has come since (the
        #: plain loop still holds them: a ``step()`` now would step them again), or None
        self.freed: list[torch.Tensor] | None = None
        #: the first step was learnt (``learn_first_step``), and the loop steps during
        #: backward since: its refusals do not suggest learning it
        self.learned = False
        #: the loop read the norm of gradients the last stepping backward freed (NaN)
        self.freed_norm_read = False
        #: steps are deferred to ``step()`` because a step hook is registered
        #: (:mod:`~overlapkit.overlap.core.step_hooks`), warned once
        self.plain_for_step_hooks = False
        self.warned_step_hooks = False
        #: the real optimizer's state kept in the plain order (:meth:`stepped_backward_ended`)
        self.state_order = PlainStateOrder()
        #: what :meth:`backward_starts` changed, for :meth:`backward_stepped_nothing`
        self._before_backward: tuple[bool, bool, bool, list[torch.Tensor] | None] = (
            False, False, False, None)

    def backward_starts(self) -> OverlapkitError | None:
        """Count a stepping backward that starts now: the error to hold until it ends
        (nothing steps in it) when the loop calls ``step()`` and has not since the
        previous stepping backward, or when the :attr:`backward_gate` refuses it, else
        None."""
        if self.backward_gate is not None:
            refusal = self.backward_gate()
            if refusal is not None:
                return refusal
        elif not self.has_stepped:
            refusal = foreign_trainer_refusal(self.technique)
            if refusal is not None:
                return refusal
        if self.window and self.calls_step:
            return backward_without_step_error(self.technique, self.accumulate)
        self._before_backward = (self.stepped_since_step, self.has_stepped,
                                 self.zeroed_after_stepping, self.freed)
        self.window += 1
        self.freed_norm_read = False
        self.stepped_since_step = self.has_stepped = True
        self.zeroed_after_stepping = False
        self.freed = None
        return None

    def backward_stepped_nothing(self) -> None:
        """The backward counted by :meth:`backward_starts` ended having stepped nothing
        (a global step held on a non-finite norm): its gradients are in ``.grad`` and
        the loop's ``step()`` is a full step of them, its ``zero_grad()`` discards them,
        as in the plain loop."""
        self.window -= 1
        (self.stepped_since_step, self.has_stepped, self.zeroed_after_stepping,
         self.freed) = self._before_backward

    def deferred_backward_starts(self) -> OverlapkitError | None:
        """A backward starts while steps are deferred: it steps nothing and is not
        counted, but the :attr:`backward_gate` is asked, so that a framework sees every
        backward of the deferred window (and refuses one before anything steps)."""
        if self.first_window is not None:
            self.first_window.backwards += 1
            self.first_window.backward_starts()
        return self.backward_gate() if self.backward_gate is not None else None

    def deferred_backward_ended(self, params: Iterable[torch.Tensor]) -> None:
        """A backward ended while steps are deferred (its gradients are in ``.grad``): the
        :attr:`first_window` marks them, to see whether the loop changes them."""
        if self.first_window is not None:
            self.first_window.mark(params)
            self.first_window.mark_settings()
            self.first_window.watch_state()
            self.first_window.watch_params(params)
            if not self.first_window.plain_order:
                self.first_window.open_data_writes(list(params))

    def starting_backward(self) -> OverlapkitError | None:
        """What a stepper calls when a backward starts: :meth:`backward_starts`, or
        :meth:`deferred_backward_starts` while steps are deferred — after deferring
        this backward's steps while a step hook is registered
        (:func:`~overlapkit.overlap.core.step_hooks.follow_step_hooks`), or refusing it
        (a global post-hook with sharded state, parameters added behind the facade:
        :func:`~overlapkit.overlap.core.step_hooks.backward_refusal`)."""
        follow_compile()  # a compiled caller of step(): eager (eager_steps)
        self.release_state()
        refusal = backward_refusal(self)
        if refusal is not None:
            return refusal
        follow_step_hooks(self)
        follow_kept_gradients(self)
        return self.deferred_backward_starts() if self.deferring else self.backward_starts()

    def stepped_backward_ended(self, engine: OverlapEngine, freed: bool) -> None:
        """A backward that stepped ``engine``'s parameters ended (``freed``: their
        gradients were freed). In a loop that calls ``step()``, or may (its first
        stepping backward), mark their gradients (kept, or freed: None), the param-group
        settings and the state, so that ``step()`` sees one the loop changed or set in
        between — too late for the step it was meant for."""
        self.release_state()  # the plain dict, to be put in the plain order
        self.state_order.follow(engine.optimizer)
        params = engine.parameters()
        self.freed = params if freed else None
        self.freed_order = next(_FREEING) if freed else 0
        if self.calls_step or self.window == 1:
            marks = FirstWindow(optimizer=self.settings_of, learned=self.learned)
            marks.mark(params)
            marks.mark_settings()
            marks.open_data_writes(params)
            marks.mark_state(self.technique if self.calls_step else None)
            marks.watch_reads(params, self.technique, self.settings_of or self, freed,
                              first=not self.calls_step)
            self.stepped_marks = marks

    def release_state(self, at_step: bool = False) -> None:
        """The optimizer's ``state`` watched since the last stepping backward is the
        plain dict again (:meth:`FirstWindow.release_state`; ``at_step``: by ``step()``)."""
        finish_after_step(self.settings_of or self)  # freed gradients read past step()
        if self.stepped_marks is not None:
            self.stepped_marks.release_state(at_step)

    def deferred(self) -> None:
        """The deferred backwards are over (``defer_steps()`` left): forget what they
        noted on the way (a stepper that tracks parameter usage overrides this)."""

    def backward_refused(self) -> None:
        """A backward raised (a refused one, or a step that failed): the loop learns of
        it there, so the window is closed and the next backward is not refused for it
        (and its gradients, reduced into ``.grad`` all the same, are not an edit)."""
        self.window = 0
        self.release_state()
        self.stepped_marks = None

    def step_called(self) -> bool:
        """``step()`` was called: whether a backward stepped since the last one (the call
        is then a no-op).

        :raises ConfigurationError: it ends a window of several stepping backwards
            (:func:`accumulation_error`).
        """
        window, self.window = self.window, 0
        self.freed_norm_read = False
        stepped, self.stepped_since_step = self.stepped_since_step, False
        zeroed, self.zeroed_after_stepping = self.zeroed_after_stepping, False
        if window:
            self.calls_step = self.steps_after_backward = True
        if window > 1:
            raise accumulation_error(self.technique, self.accumulate, window)
        if stepped and zeroed:  # the first step: zero_grad() did not know the loop yet
            raise discarded_step_error(self.technique)
        if not stepped and self.freed and all(p.grad is None for p in self.freed):
            raise step_again_error(self.technique)  # none set again by hand either
        return stepped

    def window_refusal(self, call: str, *, loading: bool = False) -> str | None:
        """Why ``call`` (``load_state_dict()``, a checkpoint's save or load) cannot run
        now, or None: between a stepping backward and ``step()``, in a loop that calls
        ``step()``, the plain ``step()`` comes after it (stepping from what a load gives,
        left out of what a save keeps), where this backward has already stepped.

        ``loading``: ``call`` changes the optimizer, and is refused in the first window
        too, while the loop's shape is not known yet: a loop that calls ``step()``
        refused the load only at that ``step()``, once it had loaded (the state and the
        param groups replaced, 0.4.0). A backward-only loop loads from its second
        backward on, or before its first."""
        if not self.window:
            return None
        if loading and self.window == 1 and not self.calls_step:
            return (f"{call} between the first stepping backward() and optimizer.step() "
                    "or zero_grad(): whether this loop calls step() after its backwards "
                    f"is not known yet, and {self.technique} has already stepped the "
                    "parameters during backward, where the plain loop's step() would "
                    "come after the load and step from what it gives. Load before the "
                    "first backward (or the forward), or after optimizer.step().")
        if not self.steps_after_backward:
            return None
        return (f"{call} between backward() and optimizer.step(): in the plain loop the "
                "step() comes after it (stepping from what a load gives, or left out of "
                f"what a save keeps), but {self.technique} had already stepped the "
                "parameters during backward. Call it before the forward or after "
                "optimizer.step().")

    def zero_grad_called(self) -> None:
        """``zero_grad()`` was called: it ends the window (see the module docstring).

        :raises ConfigurationError: it discards the gradients of a stepping backward in
            a loop that calls ``step()`` (:func:`discarded_step_error`).
        """
        if self.first_window is not None and self.deferring:
            self.first_window.discard()
        self.release_state()
        window, self.window, self.stepped_marks = self.window, 0, None
        freed_norm_read, self.freed_norm_read = self.freed_norm_read, False
        if window and self.steps_after_backward:
            raise discarded_step_error(self.technique)
        if window and freed_norm_read:
            raise skipped_on_freed_norm_error(self.technique)
        self.freed = self.kept_by_learning = None
        if self.stepped_since_step:
            self.zeroed_after_stepping = True
        if window == 1:
            self.calls_step = True
