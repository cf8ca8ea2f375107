"""Lightning's automatic optimization with an optimizer that steps during backward: what
overlapkit's Lightning strategies run in place of ``Strategy.backward`` and
``Strategy.optimizer_step`` (:class:`AutomaticOptimization`).

Lightning's plain loop, per optimizer step: ``optimizer.step(closure)``, whose closure
runs ``training_step``, ``zero_grad`` (first micro-batch of a window) and backward; then
``on_before_optimizer_step``, clipping (``gradient_clip_val``) and the step. Micro-batches
that accumulate run the closure directly, under ``no_sync()`` on DDP. Here the closure
runs once, its backward steps (clipping included, configured at set-up), the hooks are
called as Lightning calls them, and ``step()`` is the overlapped optimizer's (a no-op
after a stepping backward). On one device the accumulating backwards run under
``no_step()``, as DDP's under Lightning's ``no_sync()``. What works in the window
(:mod:`~overlapkit.integrations._lightning_window`) has its steps deferred to ``step()``.

Private to :mod:`overlapkit.integrations.lightning`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import do_nothing_closure
from lightning.pytorch.loops.optimization.automatic import Closure
from lightning.pytorch.trainer import call
from torch.nn.parallel import DistributedDataParallel

from overlapkit.errors import ConfigurationError, OverlapkitError
from overlapkit.integrations._lightning_by_hand import by_hand_warning, refuse_manual
from overlapkit.integrations._lightning_setup import clipping_of, step_patch_refusal
from overlapkit.integrations._lightning_skipped import skipped_backward
from overlapkit.integrations._lightning_window import (
    WRAPPED_CLOSURE,
    GradientWrites,
    OptimizerChanges,
    second_backward_error,
    switch_warning,
)
from overlapkit.overlap.core.window import FirstWindow
from overlapkit.overlap.facade import OverlappedOptimizerFacade

__all__ = ["AutomaticOptimization"]


def _reduces(strategy: pl.strategies.Strategy) -> bool:
    """Whether a backward now is a synchronised one (not inside DDP's ``no_sync()``,
    which Lightning enters for accumulating micro-batches)."""
    model = getattr(strategy, "model", None)
    return not isinstance(model, DistributedDataParallel) or model.require_backward_grad_sync


def _accumulates(module: pl.LightningModule) -> bool:
    """Whether Lightning runs this micro-batch's closure itself, to accumulate."""
    return bool(module.trainer.fit_loop._should_accumulate())


class AutomaticOptimization:
    """What one of overlapkit's Lightning strategies runs for backward and the optimizer
    step, once :meth:`attach` has given it the overlapped optimizer.

    :param technique: ``"overlap_ddp"`` or ``"optimizer_in_backward"``, for messages.
    :param strategy_name: the strategy's class name, for messages.
    :param accumulate_with_no_step: run the backwards of accumulating micro-batches
        under the optimizer's ``no_step()`` (one device, where Lightning has no
        ``no_sync()`` to enter).
    """

    def __init__(self, technique: str, strategy_name: str,
                 accumulate_with_no_step: bool) -> None:
        self.technique = technique
        self.strategy_name = strategy_name
        self.accumulate_with_no_step = accumulate_with_no_step
        self.optimizer: OverlappedOptimizerFacade | None = None
        self.writes: GradientWrites | None = None
        self.plain_order = False  # every step at step(), the backwards deferred
        #: the Trainer's clipping at set-up (:func:`clipping_of`), the optimizer's unless
        #: the module's configure_gradient_clipping clips (own_clipping)
        self.clipping: dict[str, float] = {}
        self.own_clipping = False
        #: inside optimizer_step's call of Lightning's closure, and the backwards it ran;
        #: inside Lightning's backward (the precision plugin's call of loss.backward)
        self._in_optimizer_step, self._closure_backwards, self._in_backward = False, 0, False
        #: stepping backwards since the last optimizer step
        self._stepped = 0
        #: until the first optimizer step of the fit, the backwards are deferred (the
        #: facade's defer_steps(), held open here; the gate is still asked at each), so
        #: that a second backward before the step is refused before anything steps; that
        #: first step() is a full step of the kept gradients, bitwise the plain step
        self._probed = True
        self._deferred = ExitStack()
        #: backwards through the losses of the probe's synchronised micro-batches: a
        #: second one is refused from a hook on the loss (a backward through a kept graph
        #: runs no DDP comm hook, so the optimizer's gate never sees it)
        self._probe_backwards = 0
        #: tensor hooks on the parameters noting backwards inside training_step
        #: (:meth:`watch_training_step`), and whether one was seen
        self._grad_hooks: list[Any] = []
        self._backward_in_training_step = self._in_training_step = False
        #: the DDP model whose parameters optimizer_in_backward frees early, until detach
        self._freeing_ddp_model: DistributedDataParallel | None = None
        #: optimizer_in_backward: the gradients the first optimizer step kept, watched for
        #: reads up to the next zero_grad, after training_step (:meth:`_after_first_step`)
        self._reads: tuple[FirstWindow, list[torch.Tensor]] | None = None
        #: what changes in the optimizer turns the fit to the plain order
        self._changes: OptimizerChanges | None = None
        self._by_hand = self._warned_by_hand = False  # in a backward of the user's closure

    def attach(self, optimizer: OverlappedOptimizerFacade, writes: GradientWrites | None,
               clipping: dict[str, float], plain_order: bool = False,
               own_clipping: bool = False) -> None:
        """Drive ``optimizer``, built with ``clipping``: from now on, a stepping backward
        anywhere but in Lightning's backward, or a second one before the optimizer step,
        is refused before anything steps in it. ``plain_order``: every step of the fit
        is taken at ``step()``, as the first one (the backwards stay deferred and keep
        their gradients until the next ``zero_grad``, as in the plain loop);
        ``own_clipping``: the module's ``configure_gradient_clipping`` clips there."""
        self.optimizer, self.writes, self.clipping = optimizer, writes, clipping
        self.plain_order, self.own_clipping = plain_order, own_clipping
        self._stepped = 0
        self._probed = False
        self._probe_backwards = 0
        self._warned_by_hand = False
        self._deferred.enter_context(optimizer.defer_steps())
        optimizer.gate_backwards(self._gate)

    def watch_training_step(self, ddp_model: DistributedDataParallel,
                            params: list[torch.Tensor]) -> None:
        """Refuse a backward run inside ``training_step`` (optimizer_in_backward on DDP),
        and make the early freeing of gradients end with the fit (:meth:`detach`).

        DDP reduces nothing there; the local gradients freed once copied are lost. A
        tensor hook per parameter notes it: this refusal, not the unreduced buckets'."""
        def note(grad: torch.Tensor) -> None:
            if self._in_training_step:
                self._backward_in_training_step = True
                for _, state in getattr(ddp_model, "_comm_hooks", ()):  # ours is raised
                    if (left := getattr(getattr(state, "stepper", state), "unreduced", None)):
                        left.refused_elsewhere = True

        self._grad_hooks = [p.register_hook(note) for p in params if p.requires_grad]
        self._freeing_ddp_model = ddp_model

    def watch_changes(self, params: list[torch.Tensor], ddp: bool) -> None:
        """After :meth:`attach`: what changes in the optimizer turns the fit to the plain
        order, seen before each training_step (:class:`OptimizerChanges`)."""
        assert self.optimizer is not None
        self._changes = OptimizerChanges(self.optimizer.optimizer, params, ddp)

    def training_step(self, step: Callable[[], Any]) -> Any:
        """``Strategy.training_step``, refused after it ran a backward that
        :meth:`watch_training_step` saw (before Lightning's backward: nothing stepped)."""
        found = None if self._changes is None or self.plain_order else self._changes.found()
        if found is not None:
            self._plain_order_from_now("from this one on", *found)
        self._in_training_step = True
        try:
            output = step()
        finally:
            self._in_training_step = False
        self._after_first_step()  # the module's training_step read the kept ones too?
        if self._backward_in_training_step:
            self._backward_in_training_step = False
            raise ConfigurationError(
                "training_step ran a backward (loss.backward() by hand): under "
                f"{self.technique} on DDP each gradient is freed once DDP has taken it, so "
                "what that backward accumulated would be lost where the plain run keeps it. "
                "Nothing was stepped. Return the loss from training_step (the sum of "
                "several) and let Lightning run the backward, or use technique='overlap_ddp'."
            )
        return output

    def detach(self) -> None:
        """The fit is over: the optimizer is released (a plain module's step hooks
        removed, the parameters unclaimed), so a later fit sets a technique up again
        and a backward by hand afterwards is a plain one; a backward through the DDP
        model Lightning drops, were it kept, is refused, never stepped by this fit's
        optimizer."""
        self._deferred.close()  # a fit that ended before its first step
        self._changes = None
        if self._reads is not None:
            window, params = self._reads
            window.unwatch(params)
            self._reads = None
        if self.optimizer is not None:
            self.optimizer.gate_backwards(self._after_fit)
            self.optimizer.release()
            self.optimizer = None
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        if self._freeing_ddp_model is not None:
            # optimizer_in_backward frees each local gradient once this DDP model has
            # taken it: a hook on the parameter's AccumulateGrad node, which stays (it
            # has no handle) and frees while the model's require_forward_param_sync is
            # true (overlap/ddp_param_hooks.py). Lightning drops this model now; a later
            # fit of the same module with another strategy would lose its gradients
            # (measured: 0.013 off plain DDP), so the flag of the dropped model is
            # cleared. tests/trainers: "optimizer_in_backward, then strategy='ddp'".
            self._freeing_ddp_model.require_forward_param_sync = False
            self._freeing_ddp_model = None

    # -- what the strategy calls ----------------------------------------------------

    def backward(self, strategy: pl.strategies.Strategy, closure_loss: torch.Tensor,
                 optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``Strategy.backward`` (the same calls, in the same order), with the backward
        itself marked as Lightning's and, on one device, accumulating micro-batches run
        under ``no_step()``."""
        module = strategy.lightning_module
        assert module is not None
        refuse_manual(module, self)  # manual optimization switched on after the set-up
        precision = strategy.precision_plugin
        strategy.pre_backward(closure_loss)
        closure_loss = precision.pre_backward(closure_loss, module)
        accumulating = (self.optimizer is not None and self.accumulate_with_no_step
                        and not self._in_optimizer_step)
        # DDP: a synchronised backward outside optimizer.step(closure) (the user's
        # optimizer_step, step wrapper or manual optimization runs it) steps nothing:
        # step() takes it in the plain order, or the next zero_grad drops it
        by_hand = (self.optimizer is not None and not self.accumulate_with_no_step
                   and not self._in_optimizer_step and _reduces(strategy))
        probing = not self._probed
        stepped_before = self._stepped
        counted = (probing and not self._adds_second_backward() and not accumulating
                   and not by_hand and _reduces(strategy) and closure_loss.requires_grad)
        handle = closure_loss.register_hook(self._count_probe_backward) if counted else None
        if by_hand or (accumulating and not _accumulates(module)):  # one device: a
            self._warn_by_hand(strategy)  # step() follows or not: a no_step() backward
        context: Any = nullcontext()
        if accumulating:
            context = self.optimizer.no_step()  # type: ignore[union-attr]
        elif by_hand and self._probed and not self.plain_order:  # else deferred already
            context = self.optimizer.defer_steps()  # type: ignore[union-attr]
        with context:
            self._in_backward, self._by_hand = True, by_hand
            self._closure_backwards += self._in_optimizer_step
            try:
                precision.backward(closure_loss, module, optimizer, *args, **kwargs)
            except RuntimeError as error:
                if self._stepped > stepped_before and "modified by an inplace" in str(error):
                    raise second_backward_error(self.technique) from error
                raise
            finally:
                self._in_backward = self._by_hand = False
                if handle is not None:
                    handle.remove()
        with self._watch("on_after_backward", self._stepped > stepped_before, probing):
            closure_loss = precision.post_backward(closure_loss, module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, strategy: pl.strategies.Strategy, optimizer: Any,
                       closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        """Lightning's ``optimizer.step(closure)``: the closure once (its backward
        steps), ``on_before_optimizer_step`` of the callbacks and the module, then the
        overlapped ``step()``. Lightning's clipping is called only when the module
        overrides it; else the backward clipped (``gradient_clip_val``, read at set-up).
        A closure that is not Lightning's (an ``optimizer_step`` override wrapping it, to
        work after its backward) turns the fit to the plain order before it runs; a
        ``step`` patched on the optimizer's instance is refused then."""
        model = model or strategy.lightning_module
        trainer = model.trainer
        if not self.own_clipping and clipping_of(trainer) != self.clipping:
            raise ConfigurationError(
                f"the Trainer's gradient_clip_val or gradient_clip_algorithm changed during "
                f"the fit, and {self.technique} clips during backward as it was set up "
                f"({self.clipping or 'no clipping'}, now {clipping_of(trainer) or 'none'}). "
                "Nothing was stepped in this step. Set the clipping before trainer.fit() "
                "and leave it; to change it, resume a new fit from a checkpoint."
            )
        if (refusal := step_patch_refusal(optimizer, self.strategy_name, self.technique)):
            raise refusal  # (a wrapper patched on the instance, before its closure runs)
        if not (self.plain_order or isinstance(closure, Closure)
                or closure is do_nothing_closure):
            self._plain_order_from_now("from this one on", *WRAPPED_CLOSURE)
        probing = not self._probed
        self._in_optimizer_step, self._closure_backwards = True, 0
        try:
            closure_result = closure()
        finally:
            self._in_optimizer_step = False
        if (not (self._closure_backwards or self.plain_order or self.accumulate_with_no_step)
                and isinstance(closure, Closure) and trainer.accumulate_grad_batches > 1):
            # the plain order reduces and steps as the plain loop does (DDP's early
            # reduction; SWA's BatchNorm epoch), refused where the gradients were freed
            self._plain_order_from_now("from this one on", *skipped_backward(
                trainer, self._freeing_ddp_model is not None, probing))
        with self._watch("on_before_optimizer_step", self._stepped > 0, probing):
            call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
            call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        if self.own_clipping:  # Lightning's call, as its precision plugin makes it
            strategy.precision_plugin._clip_gradients(
                model, optimizer, trainer.gradient_clip_val,
                gradient_clip_algorithm=trainer.gradient_clip_algorithm)
        if probing:
            if not self.plain_order:
                self._deferred.close()  # from now on the backwards step
            self._probed = True
        optimizer.step(**kwargs)  # a no-op after a stepping backward; the probe's full step
        self._stepped = 0
        if probing and not self.plain_order and self.technique == "optimizer_in_backward":
            # the probe kept the gradients, as the plain loop does until the next
            # zero_grad: a hook reading them before then is seen (on_train_batch_end's
            # overrides were seen at set-up)
            named = list(model.named_parameters())
            window = FirstWindow(watching={id(p): n for n, p in named})
            params = [p for _, p in named]
            window.mark(params)
            self._reads = (window, params)
        return closure_result  # what a torch optimizer's step(closure) returns

    def _after_first_step(self) -> None:
        """After the training_step following the first step (the plain zero_grad is next):
        a read of the gradients that step kept, by a hook or that training_step (freed from
        the second step on: None, sixth probe), takes every later step at ``step()``."""
        if self._reads is None:
            return
        (window, params), self._reads = self._reads, None
        window.unwatch(params)
        if window.read and self.optimizer is not None and not self.plain_order:
            shown = ", ".join(window.read[:3]) + (" and others" if len(window.read) > 3
                                                   else "")
            self._plain_order_from_now(
                "from the second on", f"the gradients of {shown} were read after the "
                "first optimizer step (by a hook or training_step), where the plain loop keeps "
                "them until the next zero_grad and optimizer_in_backward would have freed them",
                "read gradients in no hook nor in training_step, or use "
                "OverlapDDPStrategy(technique='overlap_ddp') (it keeps them)")

    def _plain_order_from_now(self, steps: str, why: str, keep: str) -> None:
        """Take every later step at ``step()`` in the plain order (its backwards
        deferred): bitwise, with one warning saying ``why`` and how to ``keep`` the
        overlap."""
        assert self.optimizer is not None
        self.plain_order = True
        if self._probed:  # (the first step's backwards are deferred already)
            self._deferred.enter_context(self.optimizer.defer_steps())
        warnings.warn(switch_warning(self.strategy_name, self.technique, steps, why, keep),
                      UserWarning, stacklevel=3)

    def _warn_by_hand(self, strategy: pl.strategies.Strategy) -> None:
        """Once per fit: steps taken at ``step()``, the closure run outside it."""
        if not (self._warned_by_hand or self.plain_order):
            self._warned_by_hand = True
            warnings.warn(by_hand_warning(self.strategy_name, self.technique, strategy),
                          UserWarning, stacklevel=3)

    # -- the gate ---------------------------------------------------------------------

    def _count_probe_backward(self, grad: torch.Tensor) -> None:
        """Hook on the loss of a synchronised micro-batch of the probe (the first
        optimizer step): a second backward through it is refused before it reaches a
        parameter, while nothing has stepped."""
        self._probe_backwards += 1
        if self._probe_backwards > 1:
            raise second_backward_error(self.technique)

    def _watch(self, hook: str, stepped: bool, probing: bool = False) -> Any:
        if self.writes is None:
            return nullcontext()
        return self.writes.watching(hook, stepped, probing)

    def _gate(self) -> OverlapkitError | None:
        """Asked by the overlapped optimizer when a backward that would step starts."""
        if not self._in_backward:
            return ConfigurationError(
                "a backward ran outside Lightning's backward (loss.backward() in "
                f"training_step or in a hook): {self.technique} steps the optimizer during "
                "backward, so it would be an optimizer step that the plain run never "
                "takes. Nothing was stepped in it. Return the loss from training_step and "
                "let Lightning run the backward (sum several losses into one), or train "
                "with strategy='ddp'."
            )
        if self._by_hand or self._adds_second_backward():  # deferred: steps nothing
            return None
        if self._stepped:
            return second_backward_error(self.technique)
        self._stepped += 1
        return None

    def _adds_second_backward(self) -> bool:
        """In the plain order a second backward adds to ``.grad`` as in the plain loop,
        but where optimizer_in_backward frees DDP's local gradients early (measured:
        the second backward's gradients lost, nothing stepped: refused there)."""
        return self.plain_order and self._freeing_ddp_model is None

    def _after_fit(self) -> OverlapkitError | None:
        return ConfigurationError(
            f"this model was trained with {self.strategy_name} in a fit that has ended, and "
            "its parameters still carry that fit's step hooks: this backward would step the "
            "ended fit's optimizer. Nothing was stepped. Build a new LightningModule for "
            "each fit (load the weights: new.load_state_dict(old.state_dict()), or resume "
            "with ckpt_path=)."
        )
