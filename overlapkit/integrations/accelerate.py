"""overlapkit with Hugging Face Accelerate: :func:`prepare`, next to ``accelerator.prepare``.

::

    model, optimizer = overlapkit.integrations.accelerate.prepare(
        accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3),
        technique="optimizer_in_backward", clip_grad_norm=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, ...)
    dataloader, scheduler = accelerator.prepare(dataloader, scheduler)

    for batch in dataloader:                      # the ordinary Accelerate loop
        with accelerator.accumulate(model):
            accelerator.backward(model(batch).loss)   # steps during backward
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)   # overlapkit's
            optimizer.step()                      # a no-op after a stepping backward
            scheduler.step()
            optimizer.zero_grad()

:func:`prepare` prepares the model with ``accelerator.prepare`` (Accelerate wraps it in
``DistributedDataParallel`` on several processes), sets the technique up on the
prepared model around the optimizer given (the same instance: its groups, its state and
an LR scheduler built on it stay valid), and prepares that. What the loop then calls
maps onto overlapkit's own rules:

- ``accelerator.backward(loss)`` runs backward, which steps;
- ``accelerator.clip_grad_norm_`` ends in ``torch.nn.utils.clip_grad_norm_``: with
  ``clip_grad_norm=`` set to the same ``max_norm`` it returns the total norm overlapkit
  clipped with, bitwise; any other clip raises at the first call
  (:mod:`overlapkit.overlap.rules.late_clipping`). ``clip_grad_norm`` has no default: the
  clip must be known before the first step, which happens inside the first backward;
- ``with accelerator.accumulate(model):`` runs the backwards that do not end an
  accumulation window inside ``accelerator.no_sync(model)``, which :func:`prepare`
  makes pause the steps: DDP's ``no_sync()`` (Accelerate enters it only with 2 or
  more processes), or ``optimizer.no_step()`` on a plain module;
- ``optimizer.step()`` / ``zero_grad()``, the prepared scheduler,
  ``accelerator.save_state()`` / ``load_state()``: the facade's (plain ``state_dict()``
  format); between a stepping backward and ``step()`` they are refused, writing or
  loading nothing (:mod:`~overlapkit.integrations._accelerate_window`).

What it cannot honour raises :class:`~overlapkit.errors.ConfigurationError` before
anything is prepared (:func:`check_accelerator`).

.. versionadded:: 0.3
"""

from __future__ import annotations

from overlapkit.integrations.requirements import require

require("accelerate", "accelerate", "1.15.0")

import functools  # noqa: E402
import weakref  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import AbstractContextManager, contextmanager  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from overlapkit.errors import ConfigurationError, UnsupportedModelError  # noqa: E402
from overlapkit.integrations._accelerate_window import (  # noqa: E402
    PAUSED,
    forward_past_ddp_refusal,
    guard_checkpoints,
    watch_forwards_past_ddp,
)
from overlapkit.integrations.existing_optimizer import (  # noqa: E402
    check_technique,
    overlap_existing,
)
from overlapkit.overlap.facade import OverlappedOptimizerFacade  # noqa: E402
from overlapkit.overlap.in_backward import OptimizerInBackward  # noqa: E402
from overlapkit.overlap.rebuild import live_stepper_of, release_steps  # noqa: E402

__all__ = ["check_accelerator", "overlap_prepared", "prepare", "release_elsewhere",
           "wraps_in_ddp"]

#: the distributed types whose model is a plain module or DDP
_DDP_TYPES = frozenset(DistributedType) - {
    DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.XLA,
    DistributedType.MEGATRON_LM,
}


def wraps_in_ddp(accelerator: Accelerator) -> bool:
    """Whether ``accelerator.prepare`` wraps a model in ``DistributedDataParallel``: on
    several GPUs (or other devices), and on CPU processes launched by ``torchrun`` or
    ``accelerate launch`` whatever their number (accelerate 1.15's ``prepare_model``)."""
    return bool(accelerator.multi_device
                or accelerator.distributed_type == DistributedType.MULTI_CPU)


def _refuse(setting: str, why: str, instead: str) -> ConfigurationError:
    return ConfigurationError(
        f"overlapkit cannot step the optimizer during backward with {setting}: {why}. "
        f"{instead}"
    )


def check_accelerator(accelerator: Accelerator, *, where: str = "Accelerator") -> None:
    """Refuse the Accelerate settings overlapkit cannot honour, naming each.

    :param where: how the user set the accelerator up, for messages
        (``"Accelerator"``, ``"TrainingArguments"``).
    :raises ConfigurationError: DeepSpeed, FSDP (1 or 2), Megatron-LM or XLA; tensor,
        context or sequence parallelism; FP8; fp16 loss scaling (a ``GradScaler``);
        ``torch.compile`` through Accelerate's dynamo plugin; a DDP comm hook set
        through ``DistributedDataParallelKwargs``; ``sync_each_batch=True``.
    """
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        raise _refuse("DeepSpeed", "DeepSpeed's engine partitions and steps the optimizer "
                      "itself (ZeRO), after backward",
                      f"Remove the DeepSpeed config from the {where} (deepspeed=...), or "
                      "train without overlapkit.")
    if kind == DistributedType.FSDP:
        version = getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1)
        if version == 2:
            raise _refuse("Accelerate's FSDP2 plugin", "Accelerate shards the model and "
                          "swaps the optimizer's parameters for the sharded ones inside "
                          "prepare(), where overlapkit cannot set its steps up (not "
                          "supported by this integration yet)",
                          "Use DDP (no fsdp config), or shard with torch's fully_shard and "
                          "call overlapkit.optimizer_in_backward(model, ...) in your own "
                          "loop.")
        raise _refuse("FSDP1 (FullyShardedDataParallel)", "its flat parameters hide the "
                      "per-parameter gradients",
                      f"Remove the fsdp config from the {where} (DDP is used), or "
                      "train without overlapkit.")
    if kind not in _DDP_TYPES:
        raise _refuse(f"Accelerate's {kind.value} mode", "only a plain module or a DDP "
                      "model is supported", "Train on CPU or GPUs with DDP.")
    parallelism = getattr(accelerator, "parallelism_config", None)
    for name in ("tp", "cp", "sp"):
        if parallelism is not None and getattr(parallelism, f"{name}_enabled", False):
            raise _refuse(f"{name.upper()} parallelism (parallelism_config)",
                          "the model's parameters are sharded across ranks (DTensor)",
                          "Train with data parallelism only.")
    if str(getattr(accelerator.fp8_backend, "value", "NO")) != "NO":
        raise _refuse("FP8 training", "the FP8 recipe wraps the model and the optimizer",
                      "Use bf16 mixed precision (mixed_precision='bf16').")
    if accelerator.scaler is not None:
        raise _refuse("fp16 mixed precision (a GradScaler)", "Accelerate's "
                      "AcceleratedOptimizer drives the scaler around a step() it patches, "
                      "which this integration does not take over yet",
                      "Use bf16 (mixed_precision='bf16' / TrainingArguments(bf16=True)), "
                      "which needs no loss scaling, or call "
                      "overlapkit.optimizer_in_backward(..., grad_scaler=scaler) in your "
                      "own loop.")
    dynamo = accelerator.state.dynamo_plugin
    if str(getattr(dynamo.backend, "value", dynamo.backend)).upper() != "NO":
        raise _refuse(f"torch.compile (dynamo backend {dynamo.backend.value!r})",
                      "compiling the prepared DDP model, as Accelerate does, is not "
                      "tested with overlapkit's comm hook and autograd hooks",
                      "Leave torch.compile off (no dynamo_backend / torch_compile=False), "
                      "or compile the module before it is prepared: overlapkit is tested "
                      "on DDP of a compiled module.")
    handler = accelerator.ddp_handler
    hook = getattr(handler, "comm_hook", None) if handler is not None else None
    if hook is not None and str(getattr(hook, "value", hook)) != "no":
        raise _refuse(f"the DDP comm hook {hook.value!r} of DistributedDataParallelKwargs",
                      "a DDP model takes one comm hook, and overlapkit's runs the "
                      "reduction and then the step",
                      "Leave comm_hook out of DistributedDataParallelKwargs and pass it "
                      "to overlapkit instead (comm_hook='fp16_compress', "
                      "'bf16_compress'; `overlapkit plugins` lists them).")
    if accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
        trainer = where == "TrainingArguments"
        raise _refuse("sync_each_batch=True " + (
            "(TrainingArguments(accelerator_config={'gradient_accumulation_kwargs': "
            "{'sync_each_batch': True}}))" if trainer else "(GradientAccumulationPlugin)"),
            "every backward would be reduced, and so step, where the plain loop steps once "
            "per accumulation window",
            "Leave sync_each_batch out of " + (
                "accelerator_config's gradient_accumulation_kwargs: the Trainer then runs "
                "the other micro-batches of a step in no_sync(), which step nothing, and "
                "the last one steps the sum." if trainer else
                "the GradientAccumulationPlugin: the backwards inside "
                "accelerator.accumulate() then step nothing, and the last one steps the "
                "sum."))


def _one_process_overlap_ddp() -> ConfigurationError:
    return ConfigurationError(
        "technique='overlap_ddp' steps each DDP gradient bucket as its allreduce "
        "completes, and Accelerate does not wrap the model in DistributedDataParallel "
        "in this run (one process), so there is nothing to overlap. Launch 2 or more "
        "processes with torchrun or `accelerate launch` (on CPU one launched process is "
        "enough), or use technique='optimizer_in_backward', which steps each parameter "
        "during backward on one process too."
    )


def _stepped_model(prepared: Any) -> torch.nn.Module:
    """The module overlapkit sets its steps up on: the DDP model, or the plain one."""
    if not isinstance(prepared, torch.nn.Module):
        raise UnsupportedModelError(
            f"accelerator.prepare returned {type(prepared).__name__}, not a module."
        )
    return prepared


def overlap_prepared(accelerator: Accelerator, prepared_model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer, technique: str,
                     **options: Any) -> OverlappedOptimizerFacade:
    """Set ``technique`` up on a model ``accelerator`` has prepared, stepping
    ``optimizer`` (the same instance), and make ``accelerator.no_sync(model)`` pause
    the steps (:func:`_pause_steps_in_no_sync`).

    :raises ConfigurationError: ``overlap_ddp`` on a model Accelerate did not wrap in
        DDP (one process launched without ``torchrun``), and what the technique refuses.
    """
    model = _stepped_model(prepared_model)
    if technique == "overlap_ddp" and not isinstance(model, DistributedDataParallel):
        raise _one_process_overlap_ddp()
    release_elsewhere(model)
    facade = overlap_existing(model, optimizer, technique, **options)
    _STEPPED_ON[facade._steps] = weakref.ref(model)
    if isinstance(model, DistributedDataParallel):
        _pause_steps_in_no_sync(accelerator, model, model.no_sync)
    elif isinstance(facade, OptimizerInBackward):
        _pause_steps_in_no_sync(accelerator, model, facade.no_step)
    return facade


#: the steppers :func:`overlap_prepared` set up, each with the (prepared) model it steps
_STEPPED_ON: weakref.WeakKeyDictionary[Any, weakref.ref[torch.nn.Module]] = \
    weakref.WeakKeyDictionary()


def release_elsewhere(model: torch.nn.Module, keep: Any = None) -> bool:
    """Release what :func:`overlap_prepared` set up on ``model``'s parameters through
    another prepared model (a phase with its own ``Accelerator`` or ``Trainer``: on
    several processes each wraps the module in a DDP model of its own, whose steps a new
    wrapper cannot take over), but ``keep``. A stepper on ``model`` itself is left to the
    takeover of a rebuild (docs/rebuilding.inc).

    :return: whether ``keep`` no longer steps ``model`` (released or replaced since).
    """
    params = list(model.parameters())
    found: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for param in params:
        stepper = live_stepper_of(param)
        on = _STEPPED_ON.get(stepper) if stepper is not None else None
        if on is not None and stepper is not keep and on() is not model:
            found.setdefault(id(stepper), (stepper, []))[1].append(param)
    for stepper, stepped in found.values():
        release_steps(stepper, stepped)
    return keep is not None and not any(live_stepper_of(p) is keep for p in params)


def _pause_steps_in_no_sync(accelerator: Accelerator, model: torch.nn.Module,
                            pause: Callable[[], AbstractContextManager[Any]]) -> None:
    """Make ``accelerator.no_sync(model)`` — what ``accumulate()`` and the Trainer enter
    for all but the last micro-batch — pause the steps: DDP's ``no_sync()`` on a DDP
    model, ``optimizer.no_step()`` on a plain one. Accelerate enters DDP's ``no_sync()``
    only with 2 or more processes, and nothing on a plain module; with one process
    its DDP model (on CPU) would reduce, and so step, every micro-batch (measured:
    refused at the first step() as accumulation without no_sync). This accelerator
    gets its own ``no_sync`` (an attribute of this instance; nothing else changes),
    once: each model prepared on it (two in a GAN) has its pause, and a new optimizer
    on a model (a rebuild after ``free_memory()``) replaces that model's."""
    pauses: dict[torch.nn.Module, Callable[[], AbstractContextManager[Any]]] | None = \
        getattr(accelerator, "_overlapkit_pauses", None)
    if pauses is None:
        pauses = {}
        original = accelerator.no_sync

        @contextmanager
        def no_sync(model: torch.nn.Module) -> Iterator[None]:
            with original(model):
                pausing = pauses.get(model)
                if pausing is None:
                    yield
                else:
                    with pausing():
                        setattr(accelerator, PAUSED, getattr(accelerator, PAUSED, 0) + 1)
                        try:
                            yield
                        finally:
                            setattr(accelerator, PAUSED, getattr(accelerator, PAUSED) - 1)

        accelerator.no_sync = no_sync
        accelerator._overlapkit_pauses = pauses
    pauses[model] = pause


def prepare(accelerator: Accelerator, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, *, technique: str,
            clip_grad_norm: float | None, clip_norm_type: float = 2.0,
            **options: Any) -> tuple[torch.nn.Module, AcceleratedOptimizer]:
    """``accelerator.prepare(model, optimizer)``, with ``optimizer`` stepped during
    backward by ``technique``.

    Call it instead of preparing the model and the optimizer (prepare data loaders and
    schedulers with ``accelerator.prepare`` as usual, before or after).

    :param accelerator: the ``Accelerator``, with the settings of the run.
    :param model: the model; or the model it returned before, for a new optimizer
        after ``accelerator.free_memory()`` (a second phase): kept as it is, as
        ``accelerator.prepare`` keeps it, the new optimizer taking over from the
        earlier one (docs/rebuilding.inc). What was set up on its parameters through
        another prepared model (a new ``Accelerator``'s DDP wrapper) is released
        (:func:`release_elsewhere`).
    :param optimizer: a plain ``torch.optim`` optimizer over ``model``'s parameters, not
        yet prepared; it stays the optimizer that takes the steps.
    :param technique: ``"optimizer_in_backward"`` (any number of processes; frees each
        gradient once stepped) or ``"overlap_ddp"`` (DDP: each bucket stepped as its
        allreduce completes).
    :param clip_grad_norm: the ``max_norm`` the loop passes to
        ``accelerator.clip_grad_norm_``, or None when it does not clip. Required: the
        first step is taken inside the first backward, before the loop clips.
    :param clip_norm_type: its ``norm_type``.
    :param options: other options of the technique (``clip_grad_value``,
        ``comm_hook``, ``clip_grad_norm_scope``, ...).
    :return: ``(model, optimizer)`` as ``accelerator.prepare`` returns them.
    :raises ConfigurationError: a setting overlapkit cannot honour
        (:func:`check_accelerator`), an unknown ``technique``, an optimizer already
        prepared, and what the technique refuses — all before the first step.
    """
    technique = check_technique(technique)
    check_accelerator(accelerator)
    if technique == "overlap_ddp" and not wraps_in_ddp(accelerator):
        raise _one_process_overlap_ddp()
    if isinstance(optimizer, AcceleratedOptimizer) or getattr(
            optimizer, "_is_accelerate_prepared", False):
        raise ConfigurationError(
            "the optimizer was already prepared by accelerator.prepare; pass the plain "
            "optimizer to overlapkit.integrations.accelerate.prepare, which prepares it."
        )
    # a model already prepared (a new optimizer after accelerator.free_memory(), or
    # after an earlier prepare): accelerator.prepare returns it as it is, as in the plain
    # loop, and the new call takes over from the optimizer set up on it before
    # (docs/rebuilding.inc)
    prepared = accelerator.prepare(model)
    facade = overlap_prepared(accelerator, prepared, optimizer, technique,
                              clip_grad_norm=clip_grad_norm, clip_norm_type=clip_norm_type,
                              **options)
    # Accelerate's loops call optimizer.step(): the first one shows what the loop does
    # between backward and step (overlapkit.overlap.core.window), before anything steps
    facade.learn_first_step(
        prepared, accumulate="inside `with accelerator.accumulate(model):` (or "
        "`with accelerator.no_sync(model):`)", loop_clips=clip_grad_norm)
    _refuse_backward_through_stepped(accelerator, prepared, facade)
    guard_checkpoints(accelerator, lambda: list(
        getattr(accelerator, "_overlapkit_facades", {}).values()))
    return prepared, accelerator.prepare(facade)


def _refuse_backward_through_stepped(accelerator: Accelerator, model: torch.nn.Module,
                                     facade: OverlappedOptimizerFacade) -> None:
    """Make ``accelerator.backward`` raise the facade's ConfigurationError, naming what to
    do, where autograd refuses a second backward before ``step()`` through a kept graph
    whose parameters the first backward stepped (a raw RuntimeError otherwise). Wrapped
    once per accelerator: each prepared model (two in a GAN) has its facade, and a new
    optimizer on a model (a rebuild after ``free_memory()``) replaces that model's."""
    facades: dict[torch.nn.Module, OverlappedOptimizerFacade] | None = \
        getattr(accelerator, "_overlapkit_facades", None)
    if facades is None:
        facades = {}
        backward = accelerator.backward

        @functools.wraps(backward)
        def refusing(loss: Any, **kwargs: Any) -> Any:
            past = forward_past_ddp_refusal(facades, lambda m: facades[m]._technique)
            if past is not None:
                raise past
            try:
                return backward(loss, **kwargs)
            except RuntimeError as error:
                for facade in facades.values():
                    refusal = facade.second_backward_refusal(error)
                    if refusal is not None:
                        raise refusal from error
                raise

        accelerator.backward = refusing
        accelerator._overlapkit_facades = facades
    facades[model] = facade
    if isinstance(model, DistributedDataParallel):
        watch_forwards_past_ddp(model)
