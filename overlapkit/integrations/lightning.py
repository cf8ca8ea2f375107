"""PyTorch Lightning strategies that step the optimizer during backward.

A Lightning user passes a strategy; everything else stays as written for the plain
Trainer (``configure_optimizers`` returns the plain optimizer and its LR scheduler,
``gradient_clip_val``, ``accumulate_grad_batches``, ``precision="bf16-mixed"``,
checkpoints and ``ckpt_path=``)::

    import lightning as L
    from overlapkit.integrations.lightning import OverlapDDPStrategy

    trainer = L.Trainer(strategy=OverlapDDPStrategy(), devices=2, accelerator="cpu",
                        gradient_clip_val=1.0, accumulate_grad_batches=2)
    trainer.fit(module)

- :class:`OverlapDDPStrategy` — Lightning's DDP strategy; once Lightning has wrapped
  the model, the optimizer of ``configure_optimizers`` is rebuilt as
  :func:`~overlapkit.overlap_ddp` (``technique="overlap_ddp"``, the default) or
  :func:`~overlapkit.optimizer_in_backward` (``technique="optimizer_in_backward"``)
  of the DDP model. Any number of processes, one included.
- :class:`OverlapSingleDeviceStrategy` — one device without a process group:
  :func:`~overlapkit.optimizer_in_backward` of the LightningModule.

Both train bitwise as the same Trainer with ``strategy="ddp"`` (one device: the default
strategy) and the plain optimizer. A fit that works in the window between backward and
the step (:mod:`overlapkit.integrations._lightning_window`) is stepped in the plain
order, with one warning. What they cannot honour raises an
:class:`~overlapkit.OverlapkitError` before the first step
(:mod:`overlapkit.integrations._lightning_setup`). Needs the ``lightning`` extra
(``pip install 'overlapkit[lightning]'``, Lightning 2.6.6, the version it
is tested with).

.. versionadded:: 0.3
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from overlapkit.errors import ConfigurationError

# before the modules that import Lightning: raises MissingDependencyError, naming the
# extra, when it is not installed
from overlapkit.integrations._lightning_available import TESTED_LIGHTNING, pl
from overlapkit.integrations._lightning_loop import AutomaticOptimization
from overlapkit.integrations._lightning_setup import (
    TECHNIQUES,
    check_fit,
    clipping_of,
    overlapped_like,
    plain_optimizer,
)
from overlapkit.integrations._lightning_skipped import (
    SWA_LAST_TRAINING_STEP,
    swa_batch_norm_epoch,
    swa_last_training_step,
)
from overlapkit.integrations._lightning_window import (
    GradientWrites,
    clips_itself,
    follow_hooked_loss,
    plain_order_warning,
    window_users,
)

__all__ = ["TESTED_LIGHTNING", "TECHNIQUES", "OverlapDDPStrategy",
           "OverlapSingleDeviceStrategy"]

# LightningModules an overlapkit strategy has set up and not torn down yet: their
# parameters carry its hooks
_SET_UP: weakref.WeakSet[pl.LightningModule] = weakref.WeakSet()

#: DDPStrategy options that put a comm hook or averaging of their own on the model
_OWN_COMM = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


def _install(strategy: pl.strategies.Strategy, optimizer: torch.optim.Optimizer) -> None:
    """Give ``strategy`` ``optimizer`` (Lightning's setter wraps it for the loop)."""
    strategy.optimizers = [optimizer]


class _StepsInBackward(pl.strategies.Strategy):
    """What both strategies change in a Lightning strategy: checks when a fit is set up,
    the optimizer rebuilt once Lightning has it (:meth:`_replace_optimizer`), and
    Lightning's automatic optimization run by :class:`AutomaticOptimization`."""

    _technique: str
    _automatic: AutomaticOptimization
    #: None: a user's on_train_batch_end (...) may read .grad (optimizer_in_backward then
    #: steps in the plain order); False: the user said it reads none
    _reads_grads_after_step: bool | None = None
    #: the user's on_after_backward / on_before_optimizer_step read nothing but .grad
    #: (overlap_ddp without clipping then keeps the overlap)
    _hooks_read_only_grads: bool = False
    #: optimizer_in_backward: StochasticWeightAveraging adding its BatchNorm epoch, whose
    #: step takes the last training step's gradients again (kept: that step is plain)
    _swa: Any = None

    @property
    def technique(self) -> str:
        """``"overlap_ddp"`` or ``"optimizer_in_backward"``."""
        return self._technique

    def setup(self, trainer: pl.Trainer) -> None:
        """Refuse what cannot be honoured before Lightning sets anything up (converts
        the module's precision, wraps it in DDP), then Lightning's ``setup``."""
        if trainer.state.fn == pl.trainer.states.TrainerFn.FITTING:
            self._check_fit(trainer)
        super().setup(trainer)

    def _check_fit(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        name = type(self).__name__
        check_fit(module, self.precision_plugin, name, self._technique)
        if module in _SET_UP:
            raise ConfigurationError(
                f"this {type(module).__name__} is set up by another overlapkit fit that "
                "has not been torn down (its parameters carry that fit's step hooks until "
                "its teardown releases them). Let that fit end (or fail) before fitting "
                "the module again, or build a new LightningModule (load the weights with "
                "new.load_state_dict(old.state_dict()))."
            )

    def _replace_optimizer(self, trainer: pl.Trainer, model: torch.nn.Module,
                           options: Mapping[str, Any]) -> None:
        """Replace the plain optimizer Lightning got from ``configure_optimizers`` with
        the overlapped one of ``model``, after the checks of the optimizer."""
        module = self.lightning_module
        assert module is not None
        name = type(self).__name__
        plain = plain_optimizer(self.optimizers, name)
        clipping = clipping_of(trainer)
        users, watched = window_users(
            trainer, module, self._technique, clipping=bool(clipping),
            reads_grads_after_step=self._reads_grads_after_step,
            hooks_read_only_grads=self._hooks_read_only_grads)
        # an overridden configure_gradient_clipping clips at step() (the plain order),
        # as Lightning calls it, in place of the technique's clipping
        own_clipping = clips_itself(module)
        overlapped = overlapped_like(plain, self._technique, model,
                                     {} if own_clipping else clipping, options)
        _SET_UP.add(module)
        self._swa = (swa_batch_norm_epoch(trainer, module)
                     if self._technique == "optimizer_in_backward" else None)
        # the LR schedulers stay on `plain`, the adopted optimizer the technique steps:
        # torch's "scheduler before optimizer.step()" check sees its steps, and
        # LearningRateMonitor finds it behind trainer.optimizers[0].optimizer, named as
        # in the plain run (re-pointed at `overlapped`, it logged each group twice)
        writes = (GradientWrites(list(module.named_parameters()), self._technique, watched)
                  if watched else None)
        if users:
            warnings.warn(plain_order_warning(users, name, self._technique), UserWarning,
                          stacklevel=2)
        self._automatic.attach(overlapped, writes, clipping, plain_order=bool(users),
                               own_clipping=own_clipping)
        self._automatic.watch_changes(list(module.parameters()),
                                      isinstance(model, DistributedDataParallel))
        if self._technique == "optimizer_in_backward" and isinstance(
                model, DistributedDataParallel):
            self._automatic.watch_training_step(model, list(module.parameters()))
        _install(self, overlapped)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        if (self._swa is not None and module is not None and not self._automatic.plain_order
                and self._automatic.optimizer is not None
                and swa_last_training_step(module.trainer, self._swa)):
            self._automatic._plain_order_from_now("from its last training step on",
                                                  *SWA_LAST_TRAINING_STEP)
        output = self._automatic.training_step(
            functools.partial(super().training_step, *args, **kwargs))
        follow_hooked_loss(self._automatic, output)  # a cached loss: backwards nested
        return output

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        return self._automatic.backward(self, closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        return self._automatic.optimizer_step(self, optimizer, closure, model, **kwargs)

    def teardown(self) -> None:
        """The fit is over: the optimizer is released (its hooks removed, its parameters
        unclaimed: ``Tuner.lr_find`` / ``scale_batch_size`` then ``fit``, or ``fit``
        twice, set the technique up again), then Lightning's teardown."""
        self._automatic.detach()
        module = self.lightning_module
        if module is not None:
            _SET_UP.discard(module)
        super().teardown()


class OverlapDDPStrategy(_StepsInBackward, pl.strategies.DDPStrategy):
    """Lightning's DDP strategy with the optimizer stepped during backward.

    ``configure_optimizers`` returns the plain optimizer (and LR scheduler) as for
    ``strategy="ddp"``; once Lightning has wrapped the model in
    ``DistributedDataParallel``, that optimizer instance is adopted by ``technique`` of
    the DDP model (the same object stepped: its groups, state and a kept
    ``self.optimizer`` stay live), with Lightning's
    ``gradient_clip_val`` / ``gradient_clip_algorithm`` as its exact clipping, and the LR
    schedulers drive it. Accumulation (``accumulate_grad_batches``,
    ``GradientAccumulationScheduler``) runs the other micro-batches under ``no_sync()``,
    as Lightning does. Checkpoints hold the plain optimizer's state (either loads the
    other's).

    :param technique: ``"overlap_ddp"`` (each bucket stepped as its allreduce completes;
        gradients kept) or ``"optimizer_in_backward"`` (gradients freed once stepped).
    :param comm_hook: a registered comm hook run on each bucket before its step
        (``overlapkit plugins`` lists them).
    :param comm_hook_options: keyword options for the comm hook's builder.
    :param step_thread: ``overlap_ddp`` only: see :func:`~overlapkit.overlap_ddp`.
    :param reads_grads_after_step: ``optimizer_in_backward`` only. By default, when the
        module or a callback of the user's overrides a hook that runs after a step and
        before the next ``zero_grad`` (``on_train_batch_end`` / ``_start``, the
        ``on_train_epoch_*``, ``on_validation_*`` and ``on_train_end`` hooks, the
        module's ``lr_scheduler_step``), which may
        read ``.grad`` there (the plain loop keeps the gradients until the next
        ``zero_grad``; ``optimizer_in_backward`` frees them during backward),
        every step of the fit is taken at ``optimizer.step()`` in the plain order,
        bitwise, with one warning. ``False``: those hooks read no gradients; keep the
        overlap.
    :param hooks_read_only_grads: ``overlap_ddp`` without clipping only. By default, a
        fit whose module or callbacks override ``on_after_backward`` or
        ``on_before_optimizer_step`` (or whose module overrides ``backward``) is
        stepped in the plain order, bitwise, with one warning: those hooks run before
        the plain step and may read the parameters or the optimizer state before it, or
        change ``.grad``. ``True``: they only read ``.grad`` (gradient-norm logging),
        which ``overlap_ddp`` keeps as the plain run's; keep the overlap (a change of
        ``.grad`` there, or a read of the parameters' values, is then refused at the
        first optimizer step, before anything steps).
    :param ddp_options: :class:`~lightning.pytorch.strategies.DDPStrategy`'s own
        arguments (``find_unused_parameters``, ``static_graph``, ``timeout``,
        ``start_method``, ...), but those that put a comm hook of their own on the
        model (``ddp_comm_hook``, ``ddp_comm_state``, ``ddp_comm_wrapper``,
        ``model_averaging_period``).
    :raises ConfigurationError: an unknown ``technique``, ``step_thread`` or
        ``hooks_read_only_grads=True`` with ``optimizer_in_backward``, a comm hook option
        of DDPStrategy's own.
    """

    def __init__(self, technique: str = "overlap_ddp", *, comm_hook: str = "allreduce",
                 comm_hook_options: Mapping[str, Any] | None = None,
                 step_thread: str = "backward", reads_grads_after_step: bool | None = None,
                 hooks_read_only_grads: bool = False, **ddp_options: Any) -> None:
        if technique not in TECHNIQUES:
            raise ConfigurationError(
                f"technique must be one of {', '.join(map(repr, TECHNIQUES))}, got "
                f"{technique!r}."
            )
        own = [k for k in _OWN_COMM if ddp_options.get(k) is not None]
        if own:
            raise ConfigurationError(
                f"{', '.join(own)} would put a comm hook or averaging of DDPStrategy's own on "
                f"the model, which takes one comm hook: {technique}'s. Pass a registered "
                "comm hook by name instead (comm_hook='fp16_compress', ...), or use "
                "DDPStrategy without overlapkit."
            )
        options: dict[str, Any] = {"comm_hook": comm_hook,
                                   "comm_hook_options": comm_hook_options}
        if technique == "overlap_ddp":
            options["step_thread"] = step_thread
        elif step_thread != "backward":
            raise ConfigurationError(
                "step_thread applies to technique='overlap_ddp' only; leave it out.")
        if hooks_read_only_grads and technique != "overlap_ddp":
            raise ConfigurationError(
                "hooks_read_only_grads applies to technique='overlap_ddp' only: "
                f"{technique} frees each gradient once stepped, so a hook reading .grad "
                "before optimizer.step() needs the plain order; leave it out.")
        super().__init__(**ddp_options)
        self._technique = technique
        self._reads_grads_after_step = reads_grads_after_step
        self._hooks_read_only_grads = bool(hooks_read_only_grads)
        self._overlap_options = options
        self._automatic = AutomaticOptimization(technique, type(self).__name__,
                                                accumulate_with_no_step=False)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's, then the optimizer rebuilt on the DDP model (Lightning wrapped
        it just before)."""
        super().setup_optimizers(trainer)
        if not isinstance(self.model, DistributedDataParallel):
            raise ConfigurationError(
                f"{type(self).__name__} found {type(self.model).__name__} where Lightning "
                "puts the DistributedDataParallel model; do not override configure_ddp.")
        self._replace_optimizer(trainer, self.model, self._overlap_options)

    def _register_ddp_hooks(self) -> None:
        """Nothing: the comm hook is overlapkit's (``__init__`` refuses DDPStrategy's)."""


#: OverlapDDPStrategy's own options, refused by name on one device
_DDP_ONLY = frozenset({"technique", "comm_hook", "comm_hook_options", "step_thread",
                       "hooks_read_only_grads"})


class OverlapSingleDeviceStrategy(_StepsInBackward, pl.strategies.SingleDeviceStrategy):
    """Lightning's single-device strategy with the optimizer stepped during backward
    (:func:`~overlapkit.optimizer_in_backward` of the LightningModule: each parameter
    stepped as its gradient is complete, the gradient freed).

    ``configure_optimizers`` returns the plain optimizer, as for the default strategy;
    ``gradient_clip_val``, ``accumulate_grad_batches`` (the other micro-batches run
    under ``no_step()``), LR schedulers, ``precision="bf16-mixed"`` and checkpoints work
    as there, bitwise.

    :param device: the device, as for ``SingleDeviceStrategy`` (``"cpu"``,
        ``"cuda:0"``, ...).
    :param reads_grads_after_step: see :class:`OverlapDDPStrategy`.
    :param options: ``SingleDeviceStrategy``'s other arguments.
    :raises ConfigurationError: an option of :class:`OverlapDDPStrategy`'s own
        (``technique``, ``comm_hook``, ``hooks_read_only_grads``, ...).
    """

    def __init__(self, device: Any = "cpu", *, reads_grads_after_step: bool | None = None,
                 **options: Any) -> None:
        ddp_only = sorted(set(options) & _DDP_ONLY)
        if ddp_only:
            raise ConfigurationError(
                f"{', '.join(ddp_only)}: options of OverlapDDPStrategy, which "
                f"{type(self).__name__} does not take (it runs optimizer_in_backward on "
                "one device, with no DDP model and no comm hook); leave them out, or use "
                "OverlapDDPStrategy.")
        super().__init__(device=device, **options)
        self._technique = "optimizer_in_backward"
        self._reads_grads_after_step = reads_grads_after_step
        self._automatic = AutomaticOptimization(
            "optimizer_in_backward", type(self).__name__, accumulate_with_no_step=True)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        assert self.lightning_module is not None
        self._replace_optimizer(trainer, self.lightning_module, {})

