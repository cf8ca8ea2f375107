"""overlapkit with Hugging Face's ``Trainer``: :class:`OverlapTrainer`.

::

    from overlapkit.integrations.transformers import OverlapTrainer

    trainer = OverlapTrainer(model=model, args=args, train_dataset=dataset,
                             technique="optimizer_in_backward")    # or "overlap_ddp"
    trainer.train()                                                # the Trainer's loop

Why a ``Trainer`` subclass, and not a callback or ``optimizer_cls_and_kwargs``: the
optimizer has to be set up on the model the Trainer trains — the
``DistributedDataParallel`` model Accelerate builds in ``accelerator.prepare``, *after*
the Trainer has built the optimizer — with the Trainer's clipping (``max_grad_norm``),
and gradient accumulation on one process needs ``accelerator.no_sync`` to pause the
steps; an optimizer class given through ``optimizer_cls_and_kwargs`` is built before
the model is wrapped and never sees the arguments, and a callback alone cannot refuse
settings before the Trainer prepares them. The subclass changes no step of the loop:

- the Trainer builds its optimizer as always (``args.optim``, its decay and no-decay
  groups; or ``optimizer_cls_and_kwargs``, or ``optimizers=``), builds the LR scheduler
  from ``lr_scheduler_type``, prepares both and loads ``optimizer.pt`` when resuming;
- at ``on_train_begin`` (after all of that, before the first forward) the technique is
  set up on ``trainer.model_wrapped`` around that very optimizer instance
  (:func:`~overlapkit.integrations.accelerate.overlap_prepared`): the scheduler, the
  loaded state and ``optimizer.pt``'s format stay the Trainer's. With
  ``max_grad_norm > 0`` it clips with ``clip_grad_norm=max_grad_norm``, torch's global
  clipping before the step, and the Trainer's own ``clip_grad_norm_`` call then returns
  the norm overlapkit clipped with (:mod:`overlapkit.overlap.rules.late_clipping`);
- gradient accumulation: the Trainer runs all but the last micro-batch inside
  ``accelerator.no_sync(model)``, which the integration makes pause the steps: DDP's
  ``no_sync()`` (also with one process, where Accelerate would not enter it), or
  ``optimizer.no_step()`` on a plain module.

Settings it cannot honour raise :class:`~overlapkit.errors.ConfigurationError` when the
``OverlapTrainer`` is built, or at the latest at ``on_train_begin``, before the first
step (:func:`~overlapkit.integrations.accelerate.check_accelerator`, and
:meth:`OverlapTrainer.check_optimizer` for the optimizer the Trainer built).

To combine it with another ``Trainer`` subclass, list it first:
``class MyTrainer(OverlapTrainer, SFTTrainer): ...``.

.. versionadded:: 0.3
"""

from __future__ import annotations

from overlapkit.integrations.requirements import require

require("transformers", "transformers", "5.24.0")
require("accelerate", "transformers", "1.15.0")

import warnings  # noqa: E402
import weakref  # noqa: E402
from collections.abc import Mapping  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from overlapkit.errors import ConfigurationError, UnsupportedOptimizerError  # noqa: E402
from overlapkit.integrations._trainer_window import (  # noqa: E402
    compute_loss_watched,
    plain_order_warning,
    step_patched_around,
    unsynced_micro_batch,
)
from overlapkit.integrations.accelerate import (  # noqa: E402
    check_accelerator,
    overlap_prepared,
    release_elsewhere,
    wraps_in_ddp,
)
from overlapkit.integrations.existing_optimizer import check_technique  # noqa: E402
from overlapkit.optimizer_wrapper import OptimizerWrapper  # noqa: E402
from overlapkit.overlap.core.foreign_loop import trainer_window_users  # noqa: E402
from overlapkit.overlap.core.step_hooks import step_override  # noqa: E402
from overlapkit.overlap.facade import OverlappedOptimizerFacade  # noqa: E402

__all__ = ["OverlapTrainer"]

#: options the Trainer's arguments decide, which ``overlap_options`` may not set
_FROM_ARGUMENTS = {"clip_grad_norm": "max_grad_norm", "clip_norm_type": "max_grad_norm",
                   "params": "the Trainer's param groups", "grad_scaler": "fp16"}

#: where the classes of optimizers the Trainer builds from ``args.optim`` may come from
#: (torch's own and transformers' Adafactor): stepping them part by part is what
#: overlapkit's generic engine is tested on
_KNOWN_OPTIMIZER_MODULES = ("torch.optim", "transformers.optimization")


class _SetUpOverlap(TrainerCallback):
    """Sets the technique up when training begins (see the module docstring)."""

    def __init__(self, trainer: OverlapTrainer) -> None:
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer.set_up_overlap()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A callback working in the window added during training (by another callback):
        the plain order from this step on, before its backward."""
        trainer = self._trainer()
        if trainer is not None and isinstance(
                getattr(trainer.optimizer, "optimizer", None), OverlappedOptimizerFacade):
            trainer.set_up_overlap(from_step=state.global_step + 1)


class OverlapTrainer(Trainer):
    """Hugging Face's ``Trainer``, with its optimizer stepped during backward.

    Takes the ``Trainer``'s arguments, and:

    :param technique: ``"optimizer_in_backward"`` (default; one or more processes, frees
        each gradient once stepped) or ``"overlap_ddp"`` (the DDP model Accelerate
        builds for 2 or more processes, or on CPU for one launched with ``torchrun``:
        each DDP bucket stepped as its allreduce completes).
    :param overlap_options: other keyword options of the technique (``comm_hook``,
        ``clip_grad_value``, ``step_thread``, ...); clipping by norm comes from
        ``args.max_grad_norm``.
    :param step_in_plain_order: take every step at the Trainer's ``optimizer.step()``,
        as the plain ``Trainer`` (no overlap): for code that works in the window between
        backward and step which overlapkit cannot see (see :meth:`window_users` for what
        it sees by itself).
    :raises ConfigurationError: a setting it cannot honour (DeepSpeed, FSDP,
        ``torch_compile``, ``fp16``, ...), ``overlap_ddp`` on one process without
        ``torchrun``, an optimizer given through ``optimizers=`` that overlapkit already
        set up, ``overlap_options`` the arguments decide.
    """

    def __init__(self, *args: Any, technique: str = "optimizer_in_backward",
                 overlap_options: Mapping[str, Any] | None = None,
                 step_in_plain_order: bool = False, **kwargs: Any) -> None:
        self.overlap_technique = check_technique(technique)
        options = dict(overlap_options or {})
        for name, source in _FROM_ARGUMENTS.items():
            if name in options:
                raise ConfigurationError(
                    f"overlap_options may not set {name!r}: OverlapTrainer takes it from "
                    f"{source} (TrainingArguments), so that the run is the plain "
                    "Trainer's; set it there."
                )
        self.overlap_options = options
        #: the user asked for the plain order: every step at ``optimizer.step()``
        self.overlap_in_plain_order = bool(step_in_plain_order)
        #: what turned the overlap off for this run (:meth:`window_users`), or empty
        self.overlap_off_by: list[str] = []
        #: what the Trainer's loop did that a step during backward cannot follow (seen in
        #: :meth:`training_step`); the steps stay in the plain order from then on
        self._overlap_loop_users: list[str] = []
        #: the clip the technique was set up with, the ids of the parameters requiring
        #: grad then (:meth:`_clip_users`) and the model it was set up on, or None before
        #: set-up
        self._overlap_clip_set_up: tuple[
            float | None, frozenset[int], weakref.ref[torch.nn.Module]] | None = None
        super().__init__(*args, **kwargs)
        self._overlap_optimizer_given = self.optimizer is not None
        if isinstance(self.optimizer, OptimizerWrapper):
            raise UnsupportedOptimizerError(
                f"the optimizer given through optimizers= is already an overlapkit "
                f"{type(self.optimizer).__name__}, set up before Accelerate wraps the "
                "model; give OverlapTrainer the plain optimizer (or none: it builds "
                "args.optim), and it sets the technique up on the wrapped model."
            )
        self._check_arguments()
        self.add_callback(_SetUpOverlap(self))

    def _check_arguments(self) -> None:
        """Refuse, before anything is prepared, what the run cannot honour."""
        args = self.args
        if getattr(args, "n_gpu", 0) > 1:
            raise ConfigurationError(
                "overlapkit cannot step the optimizer during backward with "
                "torch.nn.DataParallel (n_gpu > 1 in one process): launch one process per "
                "GPU with torchrun (DDP) instead."
            )
        if args.fp16:
            raise ConfigurationError(
                "overlapkit cannot step the optimizer during backward with fp16=True "
                "through the Trainer: Accelerate drives the GradScaler around a step() it "
                "patches, which this integration does not take over yet. Use bf16=True, "
                "which needs no loss scaling."
            )
        if args.torch_compile:
            raise ConfigurationError(
                "overlapkit cannot step the optimizer during backward with "
                "torch_compile=True: Accelerate compiles the prepared DDP model, which is "
                "not tested with overlapkit's comm hook and autograd hooks. Leave "
                "torch_compile off, or compile the model's modules yourself before "
                "handing it to the Trainer (overlapkit is tested on DDP of a compiled "
                "module)."
            )
        check_accelerator(self.accelerator, where="TrainingArguments")
        if self.overlap_technique == "overlap_ddp" and not wraps_in_ddp(self.accelerator):
            raise ConfigurationError(
                "technique='overlap_ddp' steps each DDP gradient bucket as its allreduce "
                "completes, and this Trainer runs one process, whose model Accelerate "
                "does not wrap in DistributedDataParallel, so there is nothing to overlap. "
                "Launch 2 or more processes with torchrun (on CPU one launched process is "
                "enough), or use technique='optimizer_in_backward'."
            )

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer the Trainer built from ``args.optim`` that overlapkit
        cannot take over: one that steps in backward itself (LOMO), a layer-wise or
        GaLore optimizer (per-parameter optimizers behind a stand-in), a schedule-free
        optimizer (its train/eval modes move the parameters), or any class outside
        torch's and transformers' own. An optimizer given through ``optimizers=`` or
        ``optimizer_cls_and_kwargs`` is the user's choice, checked by the technique as
        any other.

        :raises ConfigurationError: naming ``args.optim``.
        """
        cls = type(optimizer)
        chosen_by_user = (self.optimizer_cls_and_kwargs is not None
                          or self._overlap_optimizer_given
                          or type(self).create_optimizer is not Trainer.create_optimizer)
        reason = None
        if callable(getattr(optimizer, "train", None)):
            reason = ("it has train()/eval() modes (schedule-free), which move the "
                      "parameters between steps")
        elif cls.__module__.startswith("lomo_optim"):
            reason = "it steps the parameters during backward itself"
        elif cls.__name__ == "LayerWiseDummyOptimizer":
            reason = "per-parameter optimizers stepped from hooks stand behind it"
        elif not chosen_by_user and not cls.__module__.startswith(_KNOWN_OPTIMIZER_MODULES):
            reason = (f"its class {cls.__module__}.{cls.__qualname__} is not one of "
                      "torch's or transformers' optimizers, which overlapkit is tested on")
        if reason is not None:
            optim = getattr(self.args.optim, "value", self.args.optim)
            raise ConfigurationError(
                f"OverlapTrainer cannot step the optimizer built for optim={optim!r} "
                f"during backward: {reason}. Use a torch optimizer (optim="
                "'adamw_torch_fused', the default, 'adamw_torch', 'sgd', 'adafactor', "
                "...), or the plain Trainer."
            )

    def window_users(self) -> list[str]:
        """What in this run works in the window between backward and ``optimizer.step()``,
        which stepping during backward removes: an override of
        :data:`~overlapkit.overlap.core.foreign_loop.WINDOW_METHODS` in a subclass of
        ``OverlapTrainer`` or a Trainer subclass listed after it (a ``training_step``
        running two backwards or editing ``.grad``, a ``create_optimizer`` keeping its
        optimizer, a ``_clip_grad_norm`` of one's own), a callback
        overriding ``on_pre_optimizer_step`` / ``on_optimizer_step`` (reading or changing
        ``.grad`` there), ``step_in_plain_order=True``, an optimizer class overriding
        ``step()`` (:func:`~overlapkit.overlap.core.step_hooks.step_override`), a ``step``
        patched on ``self.optimizer`` (:func:`step_patched_around`). A callback class
        declaring ``overlapkit_reads_no_gradients = True`` is left out: it reads no
        gradient there (nor the optimizer state or parameters the step changes, which it
        would see after the step); so are the overrides of a subclass declaring it (one
        backward, no ``.grad`` edit, no optimizer kept).
        """
        found = ["step_in_plain_order=True"] if self.overlap_in_plain_order else []
        inner = getattr(self.optimizer, "optimizer", None)  # Accelerate's, then the real one
        override = step_override(getattr(inner, "optimizer", inner)
                                 if isinstance(inner, OverlappedOptimizerFacade) else inner)
        if override is not None:  # it would run once per part stepped during backward
            found.append(override)  # a subclass's override, or a patch on the instance
        return (found + step_patched_around(self.optimizer)
                + trainer_window_users(self, skip=(OverlapTrainer,))
                + self._clip_users() + self._overlap_loop_users)

    def _trainer_clip(self) -> float | None:
        """The ``clip_grad_norm=`` that matches the Trainer's clip with ``args`` as they are
        now: ``max_grad_norm`` when > 0; else ``inf`` under ``optimizer_in_backward`` (the
        norm the Trainer logs, :meth:`set_up_overlap`), else None."""
        max_norm = self.args.max_grad_norm
        if max_norm is not None and max_norm > 0:
            return float(max_norm)
        return float("inf") if self.overlap_technique == "optimizer_in_backward" else None

    def _clip_users(self) -> list[str]:
        """Why the Trainer's clip, ``clip_grad_norm_(model.parameters(), max_grad_norm)``
        before each ``optimizer.step()``, would not be the one the technique applies during
        backward (``clip_grad_norm=``, over the optimizer's parameters, fixed at set-up):
        parameters that require grad outside the optimizer (their gradients count in the
        Trainer's norm), and, once set up, ``args.max_grad_norm`` or a ``requires_grad``
        changed since (a callback lowering the clip, unfreezing a layer). Each is seen
        before the backward that would step (:meth:`training_step`); before, the Trainer's
        clip was refused after that step had been taken, or its norm silently differed."""
        if not isinstance(self.model, torch.nn.Module) or self.optimizer is None:
            return []
        trainable = frozenset(id(p) for p in self.model.parameters() if p.requires_grad)
        if self._overlap_clip_set_up is not None:
            clip, before, _ = self._overlap_clip_set_up
            found = []
            if self._trainer_clip() != clip:
                found.append(f"max_grad_norm={self.args.max_grad_norm}, changed since the "
                             "technique was set up to clip as the Trainer did then")
            if trainable != before:
                changed = len(trainable ^ before)
                found.append(f"requires_grad changed on {changed} parameter"
                             f"{'s' if changed > 1 else ''} since the technique was set up "
                             "(the Trainer's clip counts the "
                             "gradients of every parameter that requires grad)")
            return found
        stepped = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        outside = len(trainable - stepped)
        if not outside or self._trainer_clip() is None:
            return []
        return [f"{outside} parameter{'s' if outside > 1 else ''} requiring grad outside the "
                "optimizer (the Trainer's clip_grad_norm_ over model.parameters() counts "
                "their gradients)"]

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's, after a look at what changed since the technique was set up
        (:meth:`window_users`: a window callback added since, even by another callback's
        ``on_step_begin`` that runs after this Trainer's own; :meth:`_clip_users`) and at
        whether this micro-batch, run outside ``no_sync``, ends no optimizer step
        (:func:`~overlapkit.integrations._trainer_window.unsynced_micro_batch`): any of
        them turns the rest of the run to the plain order before this micro-batch's
        backward, which would step; so does a ``compute_loss`` of one's own running a
        backward (:func:`~overlapkit.integrations._trainer_window.compute_loss_watched`)."""
        facade = getattr(self.optimizer, "optimizer", None)
        if isinstance(facade, OverlappedOptimizerFacade) and not self.overlap_off_by:
            self._overlap_loop_users = unsynced_micro_batch(self)
            if self.window_users():
                self.set_up_overlap(from_step=self.state.global_step + 1)
        if not isinstance(facade, OverlappedOptimizerFacade):
            return super().training_step(*args, **kwargs)
        with compute_loss_watched(self, facade, skip=(OverlapTrainer,)):
            return super().training_step(*args, **kwargs)

    def set_up_overlap(self, from_step: int | None = None) -> None:
        """Set the technique up on ``self.model_wrapped`` around the optimizer the Trainer
        prepared (called at ``on_train_begin``; a second ``train()`` keeps it).

        When something in the run works in the window between backward and step
        (:meth:`window_users`), every step is taken by the Trainer's ``optimizer.step()``
        in the plain order instead — the plain ``Trainer``'s run, bitwise — with one
        warning naming what turned the overlap off and how to keep it. A ``train()``
        after one that set the technique up, or a step of it (``on_step_begin``: a
        callback added since), switches the set-up optimizer to the plain order, which
        it keeps from then on
        (:meth:`~overlapkit.overlap.facade.OverlappedOptimizerFacade.learn_first_step`).
        What another ``OverlapTrainer`` set up on the same model (an earlier phase with
        its own Trainer, its own DDP wrapper) is released first
        (:func:`~overlapkit.integrations.accelerate.release_elsewhere`).

        :param from_step: the step about to begin, when called during training (the
            warning names it).
        """
        prepared = self.optimizer
        if (from_step is None and self._overlap_clip_set_up is not None
                and self._overlap_clip_set_up[2]() is not self.model):
            # a new model (model_init builds one at each train(), each hyperparameter
            # trial): what changed since the last set-up is no longer the question (it
            # was: every parameter's requires_grad "changed", the overlap off)
            self._overlap_clip_set_up = None
        users = self.window_users()
        facade = getattr(prepared, "optimizer", None)
        set_up = isinstance(facade, OverlappedOptimizerFacade)
        own = getattr(facade, "_steps", None)
        # at train() only (another Trainer cannot have begun since within this run)
        released = (from_step is None and isinstance(self.model_wrapped, torch.nn.Module)
                    and release_elsewhere(self.model_wrapped, own))
        if users:
            if users != self.overlap_off_by:  # one warning, not one per train()
                warnings.warn(plain_order_warning(self.overlap_technique, users, from_step),
                              UserWarning, stacklevel=2)
            self.overlap_off_by = users
            if isinstance(facade, OverlappedOptimizerFacade) and not released:  # set up by
                facade.learn_first_step(plain_order=True)  # an earlier train(): a callback
            elif set_up:  # released by another OverlapTrainer since: the plain optimizer
                prepared.optimizer = facade.optimizer  # type: ignore[union-attr]
                self._overlap_clip_set_up = None
            return
        if set_up and not released:
            return  # a second train() keeps what the first set up
        if isinstance(facade, OverlappedOptimizerFacade):
            # released by another OverlapTrainer since: set up again, same optimizer
            prepared.optimizer = facade.optimizer  # type: ignore[union-attr,unused-ignore]
        self.overlap_off_by = []
        if not isinstance(prepared, AcceleratedOptimizer):
            raise ConfigurationError(
                "OverlapTrainer expected the optimizer prepared by Accelerate "
                f"(AcceleratedOptimizer), found {type(prepared).__name__}; was "
                "trainer.optimizer replaced after the Trainer was built?"
            )
        inner = prepared.optimizer
        self.check_optimizer(inner)
        # max_grad_norm=0: the plain Trainer logs clip_grad_norm_(params, inf) of the
        # gradients, which optimizer_in_backward frees once stepped: clipping to inf
        # computes that norm before the step and scales by exactly 1.0 (torch clamps the
        # coefficient), and the Trainer's clip_grad_norm_(params, inf) then returns it
        # (late_clipping)
        clip = self._trainer_clip()
        prepared.optimizer = overlap_prepared(
            self.accelerator, self.model_wrapped, inner, self.overlap_technique,
            clip_grad_norm=clip, **self.overlap_options)
        model = self.model
        assert isinstance(model, torch.nn.Module)  # the Trainer has one to train
        self._overlap_clip_set_up = (clip, frozenset(
            id(p) for p in model.parameters() if p.requires_grad), weakref.ref(model))

