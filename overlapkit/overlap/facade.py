"""The ``torch.optim.Optimizer`` that overlapped techniques return to the user.

:class:`OverlappedOptimizerFacade` fronts an :class:`~overlapkit.OverlapEngine`
engine whose steps happen during backward. Its ``param_groups``, ``state``,
``defaults``, ``state_dict()`` and ``load_state_dict()`` are those of the real
optimizer inside, so LR schedulers drive it and checkpoints load into a plain optimizer
of the same class and back; :meth:`~OverlappedOptimizerFacade.step` is a no-op after a
backward that already stepped, so existing training loops keep working.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from overlapkit.errors import ConfigurationError, NotPicklableError, OverlapkitError
from overlapkit.optimizer_wrapper import OptimizerWrapper
from overlapkit.overlap.backward_steps import BackwardSteps
from overlapkit.overlap.core.closures import closure_refusal
from overlapkit.overlap.core.engine import OverlapEngine
from overlapkit.overlap.core.first_step import end_first_window, zeros_refusal, zeros_warning
from overlapkit.overlap.core.group_sizes import sizes_refusal
from overlapkit.overlap.core.kept_graph import second_backward_refusal
from overlapkit.overlap.core.late_changes import accept_unchanged_rewrites as accept_rewrites
from overlapkit.overlap.core.late_changes import refuse_changed_gradients
from overlapkit.overlap.core.step_hooks import step_called
from overlapkit.overlap.core.window import FirstWindow
from overlapkit.overlap.core.zeroing import GradZeroing
from overlapkit.overlap.rebuild import refuse_retired, release_steps
from overlapkit.overlap.rules.amp_scaler import (
    guard_param_groups,
    hand_inf_check,
    refuse_scaler_step,
)
from overlapkit.overlap.rules.global_step import model_order
from overlapkit.overlap.rules.late_clipping import watch
from overlapkit.overlap.rules.released import is_released, loop_clipped, released_rule
from overlapkit.overlap.setup import (
    check_unclaimed,
    claim_params,
    flatten_params,
    materialise_params,
)

__all__ = ["BackwardSteps", "OverlappedOptimizerFacade"]


class OverlappedOptimizerFacade(OptimizerWrapper):
    """A ``torch.optim.Optimizer`` whose steps happen during backward.

    It wraps the engine's real optimizer (:class:`~overlapkit.OptimizerWrapper`): groups,
    state and hooks are that optimizer's. What changes the real optimizer
    (``zero_grad``, ``state_dict``, ``load_state_dict``, ``add_param_group``, a new
    ``param_groups`` list) goes through the engine, under its lock, because backward
    may be stepping it from a comm-hook thread.

    :param engine: steps the parameters.
    :param steps: tells whether a backward has stepped since the last ``step()``.
    :param technique: the function that built it, for messages.
    :param check_params: validates a param group given to :meth:`add_param_group`.
    """

    def __init__(self, engine: OverlapEngine, steps: BackwardSteps, technique: str,
                 check_params: Callable[..., None] | None = None) -> None:
        super().__init__(engine.optimizer)
        self._engine = engine
        self._steps = steps
        self._technique = technique
        self._check_params = check_params
        steps.settings_of = engine.optimizer
        self._zeroing = GradZeroing(engine.optimizer, technique == "optimizer_in_backward")
        watch(engine.parameters(), steps)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The real ``optim_cls`` instance that takes the steps."""
        return self._engine.optimizer

    @property
    def engine(self) -> OverlapEngine:
        """The :class:`~overlapkit.OverlapEngine` taking the steps."""
        return self._engine

    def quiesced(self) -> AbstractContextManager[Any]:
        """The engine's lock: no bucket is stepped while it is held."""
        return self._engine.lock

    def replace_param_groups(self, groups: list[dict[str, Any]]) -> None:
        with self._engine.lock:
            self._engine.optimizer.param_groups = groups
            self._engine.reindex()

    #: ``torch.amp.GradScaler.step`` hands an optimizer with this flag the scale and
    #: the inf check as attributes (``grad_scale``, ``found_inf``) and calls its
    #: ``step()`` directly, instead of unscaling its gradients itself: so ``step()``
    #: sees that a GradScaler drives it (:meth:`_scaler_driving`); not once released.
    _step_supports_amp_scaling = property(lambda self: not is_released(self._steps))

    def _scaler_driving(self) -> Any | None:
        """The ``grad_scaler=`` scaler when a ``GradScaler`` calls :meth:`step` (it set
        ``grad_scale``/``found_inf``), else None; a ``ConfigurationError`` without one
        (:func:`~overlapkit.overlap.rules.amp_scaler.refuse_scaler_step`: the steps took
        the *scaled* gradients, 1.7e15 off plain DDP after 3 steps)."""
        rule = self._steps.full_step
        return refuse_scaler_step(self, self._technique,
                                  None if rule is None else rule.grad_scaler)

    @property
    def _opt_called(self) -> bool:
        """What an LR scheduler reads at its first ``step()`` to warn that
        ``optimizer.step()`` never ran: true once a backward has stepped too, so the
        backward-only loops (no ``optimizer.step()`` at all) get no false warning."""
        return bool(self.__dict__.get("_opt_called_by_step")) or self._steps.has_stepped

    @_opt_called.setter
    def _opt_called(self, value: bool) -> None:
        self.__dict__["_opt_called_by_step"] = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The real optimizer's groups. ``GradScaler.unscale_`` reading them is refused
        (:func:`~overlapkit.overlap.rules.amp_scaler.guard_param_groups`)."""
        rule = self._steps.full_step
        if not is_released(self._steps):  # released: a scaler unscales as torch's does
            guard_param_groups(sys._getframe(1), self._technique, rule and rule.grad_scaler)
        return self._wrapped.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.replace_param_groups(groups)

    @contextmanager
    def defer_steps(self) -> Iterator[None]:
        """Backwards inside step nothing: their gradients are reduced as usual (DDP's
        buckets, FSDP2's reduce-scatters) and kept in ``.grad``, and the next ``step()``
        is an ordinary full step of them, with the same clipping and loss-scaler rules
        as a step in backward (:mod:`~overlapkit.overlap.rules.global_step`) — the plain
        loop's step, bitwise.

        For a framework that must see a whole optimizer step's backwards before anything
        steps: Lightning's first closure (:mod:`overlapkit.integrations.lightning`) runs
        inside, so that a closure running two backwards, or a hook changing gradients,
        is refused before the first step. Unlike ``no_step()`` / ``no_sync()`` (gradient
        accumulation), a DDP model still reduces every bucket.
        """
        steps = self._steps
        steps.deferring = True
        try:
            yield
        finally:
            steps.deferring = False
            steps.deferred()

    def learn_first_step(self, model: torch.nn.Module | None = None,
                         accumulate: str | None = None, *, plain_order: bool = False,
                         loop_clips: float | None = None) -> None:
        """Defer the first optimizer step, to see what the loop does between backward and
        ``step()`` before anything steps (:mod:`~overlapkit.overlap.core.window`), then step
        during backward from the second step on — or, when the loop used that window
        (several backwards before ``step()``, a gradient changed), keep taking every
        step at ``step()`` in the plain order, with one warning.

        For a loop that calls ``step()`` (Accelerate's, or a hand-written one working in
        that window, :data:`~overlapkit.overlap.core.window.LEARN`); one that never does
        would step nothing. ``model`` names the parameters in the warning;
        ``accumulate`` says, in the refusal of a later second backward before
        ``step()``, how that framework accumulates (``"inside `with ...`"``).
        ``plain_order``: every step at ``step()`` from now on, nothing to learn (an
        integration that found the loop uses the window after set-up warns itself).
        ``loop_clips``: the ``clip_grad_norm=`` the loop says it clips with itself before
        ``step()``; a first step it did not clip before is refused, nothing stepped
        (Accelerate's ``prepare``: the sixth probe found such a loop clipped silently).
        """
        steps = self._steps
        if plain_order and steps.first_window is not None and steps.first_window.plain_order:
            return
        if accumulate is not None:
            steps.accumulate = accumulate
        if model is not None:  # else the names given before, or the model's
            self._names = {id(p): name for name, p in model.named_parameters()}
        # a gradient read in the window is the plain loop's only while the technique
        # keeps it unclipped (overlap_ddp without clipping or a loss scaler)
        reads_matter = self._technique == "optimizer_in_backward" or steps.full_step is not None
        steps.first_window = FirstWindow(
            watching=dict(self._parameter_names()) if reads_matter and not plain_order
            else None,
            optimizer=self._engine.optimizer, plain_order=plain_order,
            loop_clips=loop_clips)
        steps.deferring = True

    def defer_next_step(self) -> None:
        """:meth:`learn_first_step` again, with the ``loop_clips`` it was given: a model
        averager's ``before_step`` uses the parameters before the next step."""
        window = self._steps.first_window
        self.learn_first_step(loop_clips=None if window is None else window.loop_clips)

    @property
    def steps_in_plain_order(self) -> bool:
        """Every step is taken at ``step()``, in the plain order (the loop used its window)."""
        window = self._steps.first_window
        return window is not None and window.plain_order

    def _parameter_names(self) -> dict[int, str]:
        """``id(param)`` -> the model's name for it, for the window's refusals: those
        :meth:`learn_first_step` was given, else the model's the technique was built
        on (taken once)."""
        names: dict[int, str] | None = getattr(self, "_names", None)
        if names is None:
            model = getattr(self, "_model", None)
            names = {} if not isinstance(model, torch.nn.Module) else {
                id(p): name for name, p in model.named_parameters()}
            self._names = names
        return names

    def second_backward_refusal(self, error: BaseException) -> OverlapkitError | None:
        """:func:`~overlapkit.overlap.core.kept_graph.second_backward_refusal`, for an
        integration that runs the loop's backward (Accelerate's)."""
        return second_backward_refusal(self._steps, error)

    def gate_backwards(self, gate: Callable[[], OverlapkitError | None] | None) -> None:
        """Have ``gate`` asked each time a backward that would step starts (None: stop).

        For a training framework that runs the backward itself and knows where (Lightning's
        strategy, :mod:`overlapkit.integrations.lightning`): an error the gate returns
        refuses that backward as the loop-shape checks refuse one
        (:mod:`~overlapkit.overlap.core.step_accounting`) — nothing is stepped in it, every DDP
        bucket is still reduced, and the error is raised when it ends, on every rank.
        Backwards that step nothing (``no_sync()`` / ``no_step()``) do not ask it.
        """
        self._steps.backward_gate = gate

    def release(self) -> None:
        """Stop stepping during backward (a framework's fit has ended: Lightning's
        teardown; a loop goes on with a plain optimizer): a plain module's step hooks are
        removed, a DDP model's comm hook only reduces from now on, and the parameters
        are no longer claimed nor guarded against torch's clipping, so a technique may
        be set up on them again (``Tuner.lr_find`` then ``fit``; ``fit`` twice).
        Idempotent (:func:`~overlapkit.overlap.rebuild.release_steps`)."""
        release_steps(self._steps, self._engine.parameters())

    def clip_in_order(self, params: Iterable[torch.Tensor]) -> None:
        """Compute the total norm of ``clip_grad_norm=`` over the gradients in the order of
        ``params`` instead of ``model.parameters()``'s.

        For a framework whose plain loop clips in another order (Lightning's precision
        plugins, group by group): torch's total norm rounds differently in another order
        (:mod:`~overlapkit.overlap.rules.global_step`). Parameters not in ``params`` come
        after them, in the optimizer's order. No effect without norm clipping.
        """
        order = model_order(params)
        for rule in (self._steps.global_step, self._steps.full_step):
            if rule is not None:
                rule.order = order

    def synchronize(self) -> None:
        """Wait (on the current stream) for every step enqueued on a side stream.

        Called by :meth:`step`, :meth:`zero_grad`, :meth:`state_dict`,
        :meth:`load_state_dict` and before each forward of the model; call it yourself
        before reading parameters or optimizer state some other way after a backward
        that raised (its end-of-backward join did not run). No-op on CPU.
        """
        self._steps.synchronize()

    # -- the Optimizer API ------------------------------------------------------

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Nothing to do after a backward that stepped: its parameters were stepped
        as their gradients arrived. Otherwise (no stepping backward since the last
        ``step()``: only ``no_sync()``/``no_step()`` backwards, or ``.grad`` set by
        hand) an ordinary step of every parameter with a gradient, as the plain
        optimizer would take, with the same clipping and loss-scaler rules as the steps
        in backward (:func:`~overlapkit.overlap.rules.global_step.step_rules`). Called
        from a ``torch.compile``'d function (torch's recipe for compiling the optimizer)
        it runs eagerly, a graph break: the steps are the eager ones taken in backward.

        :raises ConfigurationError: a closure was passed; a ``GradScaler`` that was
            not passed as ``grad_scaler=`` calls it; it ends a window of several
            stepping backwards (gradient accumulation without ``no_sync()`` /
            ``no_step()``, :mod:`overlapkit.overlap.core.step_accounting`).
        """
        refuse_retired(self._steps, "step()")
        self._steps.release_state(at_step=True)  # the loop's reads, writes watched
        if closure is not None:
            raise closure_refusal(self._technique, self._steps.stepped_since_step)
        scaler = self._scaler_driving()
        self.synchronize()
        steps, names = self._steps, self._parameter_names()
        # the first window learnt (learn_first_step): the plain order kept, or not
        clipped_by_loop = (steps.first_window is not None and steps.deferring and end_first_window(
            steps, names, self._engine.parameters(), self._technique))
        try:
            stepped = steps.step_called()
            step_called(steps, stepped)  # an override of step() run per part: refused
        except ConfigurationError:
            for name in ("found_inf", "grad_scale"):  # as GradScaler.step would
                self.__dict__.pop(name, None)
            raise
        marks, steps.stepped_marks = steps.stepped_marks, None
        if marks is not None:
            marks.release_state()
        if stepped:
            if marks is not None:
                refuse_changed_gradients(marks, names, self._engine.parameters(),
                                         self._technique)
            rule = steps.global_step
        else:
            rule = released_rule(steps) if is_released(steps) else steps.full_step
            if rule is None or (clipped_by_loop and rule.grad_scaler is None):
                # the loop's own clip of the kept gradients was the plain loop's
                rule = None
                self._engine.step()
            else:
                with self._engine.lock:
                    rule.step(self._engine, self._engine.parameters())
        if scaler is not None and rule is not None:
            # the inf check of this step, handed over once: a later step() hands its own
            hand_inf_check(self, scaler, rule.found_inf_per_device)
            rule.found_inf_per_device = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The real optimizer's ``zero_grad``. Also ends the optimizer iteration: the
        next backward may step (see :mod:`overlapkit.overlap.core.step_accounting`).

        :raises ConfigurationError: ``set_to_none=False`` (or an own ``zero_grad``
            that zeroes: :mod:`~overlapkit.overlap.core.zeroing`) after a backward that
            freed the gradients it stepped, before anything is zeroed (``zeros_refusal``);
            before one, once learnt, later steps take the plain order, with one warning."""
        refuse_retired(self._steps, "zero_grad()")
        zeroes, asked = not set_to_none or self._zeroing.zeroes, False
        if zeroes is None:  # an override of zero_grad, not asked yet (core/zeroing.py)
            self.synchronize()
            with self._engine.lock:
                zeroes, asked = self._zeroing.ask(self._engine.optimizer.zero_grad), True
        what = self._zeroing.what if set_to_none else "zero_grad(set_to_none=False)"
        if zeroes and self._steps.freed:
            raise zeros_refusal(self._technique, what)
        if (zeroes and self._technique == "optimizer_in_backward"
                and self._steps.learned and self._steps.first_window is None):
            # learnt, before a backward freed anything: the plain order keeps the zeros
            warnings.warn(zeros_warning(self._technique, what), UserWarning, stacklevel=2)
            self.learn_first_step(plain_order=True)
        self._steps.zero_grad_called()
        loop_clipped(self._steps)  # released: the next gradients not clipped yet
        self.synchronize()
        if not asked:
            self._engine.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return self._engine.state_dict()

    def checkpoint_refusal(self, *, loading: bool = False) -> str | None:
        """Refused between a stepping backward and ``step()``, as :meth:`load_state_dict`
        (a load also in the first window, a save taken there)."""
        return self._steps.window_refusal("a checkpoint", loading=loading)

    def rewritten_unchanged(self, versions: dict[int, int]) -> None:
        accept_rewrites(self._steps, self._engine.parameters(), versions)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if (refusal := self._steps.window_refusal("optimizer.load_state_dict()",
                                                  loading=True)) is not None:
            raise ConfigurationError(f"{refusal} Nothing was loaded.")
        if isinstance(state_dict, Mapping) and (sizes := sizes_refusal(
                self._engine.optimizer, state_dict, getattr(self, "_model", None),
                self._technique)):
            raise sizes  # a plain loop's dict with frozen parameters: torch's bare error
        self.synchronize()
        self._engine.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of the model's parameters (validated like ``params``), stepped
        from the next backward on as those given at set-up (same hooks and claim)."""
        refuse_retired(self._steps, "add_param_group()")
        (group,) = materialise_params([param_group])
        if self._check_params is not None:
            self._check_params([group], self._engine.optimizer)
        engine = self._engine
        params = flatten_params([group])
        # parameters the engine already owns are left to the optimizer's own error
        check_unclaimed([p for p in params if not engine.owns(p)], self._technique)
        engine.add_param_group(group)
        self._steps.register(params)
        claim_params(params, self._technique)
        watch(params, self._steps)

    def __getstate__(self) -> dict[str, Any]:
        raise NotPicklableError(
            f"this {type(self).__name__} is bound to a live model (hooks step it during "
            "backward), so it cannot be pickled or deep-copied; save or copy "
            "optimizer.state_dict() instead (copy.deepcopy(opt.state_dict())).")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._engine.optimizer!r})"
