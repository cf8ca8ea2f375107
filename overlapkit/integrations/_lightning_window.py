"""The window between backward and the optimizer step, in Lightning: which hooks and
overrides of a fit work in it, the one warning of a fit that is therefore stepped in the
plain order, and the watch on ``.grad`` for the hooks a fit keeps the overlap with.

In Lightning's plain loop the gradients exist from the backward until the next step's
``zero_grad`` (run in the closure, after ``training_step``); ``on_after_backward``,
``on_before_optimizer_step`` and a ``LightningModule.backward`` override run before
the step, and see the gradients, the parameters and the optimizer state as they were
before it. An optimizer stepping during backward has already changed the last two (and,
under ``optimizer_in_backward``, freed the gradients), and a change of ``.grad`` there
would miss the step; after the step the plain loop keeps the gradients until the next
``zero_grad``, which ``optimizer_in_backward`` frees. Whatever of this a fit overrides
is honoured by taking every step of that fit at ``optimizer.step()``, in the plain order
(the facade's ``defer_steps()``): bitwise the plain run, with one warning
(:func:`window_users`, :func:`plain_order_warning`). What changes in the optimizer during
the fit that no backward can step (:class:`OptimizerChanges`) turns the rest of the fit
to the plain order the same way, as does a loss returned with a hook on it
(:func:`follow_hooked_loss`: a cached, GradCache-style loss running backwards during
Lightning's).

Private to :mod:`overlapkit.integrations.lightning`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.core.watched_params import (
    unwatch_params,
    watch_params,
    watched_class,
)

__all__ = ["AFTER_STEP_HOOKS", "GRADIENT_HOOKS", "WRAPPED_CLOSURE",
           "WRITING_HOOKS", "GradientWrites", "OptimizerChanges",
           "clips_itself", "follow_hooked_loss", "plain_order_warning",
           "second_backward_error", "switch_warning", "window_users"]

#: the hooks of a LightningModule or a Callback that Lightning's plain loop calls after
#: backward and before the step (and before clipping): the gradients, parameters and
#: optimizer state they see are the ones before the step
WRITING_HOOKS = ("on_after_backward", "on_before_optimizer_step")
#: those, and the one before the next ``zero_grad`` (the parameters are stepped by then,
#: as in the plain loop; only ``optimizer_in_backward`` has freed the gradients)
GRADIENT_HOOKS = (*WRITING_HOOKS, "on_before_zero_grad")
#: the hooks that run after an optimizer step and before the next ``zero_grad`` (in the
#: next closure), where the plain loop still holds that step's gradients and
#: ``optimizer_in_backward`` has freed them (validation runs there too); a read in the
#: first step's window is also seen as it happens, but not one that first comes later
#: (the module's ``lr_scheduler_step`` too: twelfth probe, a read from the third step on
#: was silently 0.016 off the plain fit)
AFTER_STEP_HOOKS = ("on_train_batch_end", "on_train_batch_start", "on_train_epoch_end",
                    "on_train_epoch_start", "on_validation_start",
                    "on_validation_epoch_start", "on_validation_batch_start",
                    "on_validation_batch_end", "on_validation_epoch_end",
                    "on_validation_end", "on_train_end", "lr_scheduler_step")
#: LightningModule methods whose override works in the window, and the techniques it
#: matters to: ``backward`` (a change or read of ``.grad`` after ``loss.backward()``),
#: ``configure_gradient_clipping`` (the user's clipping, called before the step: the
#: plain order calls it there), ``optimizer_zero_grad`` (gradients kept past a step)
WINDOW_METHODS = {"backward": ("overlap_ddp", "optimizer_in_backward"),
                  "configure_gradient_clipping": ("overlap_ddp", "optimizer_in_backward"),
                  "optimizer_zero_grad": ("optimizer_in_backward",)}


def _users(hook: Any) -> bool:
    """Whether ``hook`` (a bound method, or a function a ``LambdaCallback`` holds) is
    user code, not one of Lightning's own callbacks (progress bars, ``ModelCheckpoint``,
    the tuner's: they read no gradients)."""
    return not getattr(hook, "__module__", "").startswith("lightning.")


def overriding(trainer: pl.Trainer, module: pl.LightningModule, hooks: tuple[str, ...]
               ) -> list[tuple[str, str]]:
    """``(owner, hook)`` of each of ``hooks`` that user code overrides: the module's, or
    a callback's that is not one of Lightning's own."""
    found = [(type(module).__name__, hook) for hook in hooks if is_overridden(hook, module)]
    callbacks: list[Callback] = getattr(trainer, "callbacks", [])  # a property, untyped
    for callback in callbacks:
        found += [(type(callback).__name__, hook) for hook in hooks
                  if is_overridden(hook, callback, Callback) and _users(getattr(callback, hook))]
    return found


def clips_itself(module: pl.LightningModule) -> bool:
    """Whether the module clips by its own ``configure_gradient_clipping``."""
    return bool(is_overridden("configure_gradient_clipping", module))


def window_users(trainer: pl.Trainer, module: pl.LightningModule, technique: str, *,
                 clipping: bool, reads_grads_after_step: bool | None,
                 hooks_read_only_grads: bool) -> tuple[list[str], list[tuple[str, str]]]:
    """What of this fit works in the window, so that every step is taken at
    ``optimizer.step()`` in the plain order (``"Owner.hook"``), and the hooks whose
    changes of ``.grad`` are watched instead (:class:`GradientWrites`): those of
    :data:`WRITING_HOOKS` when ``hooks_read_only_grads`` says they read nothing but the
    gradients, which ``overlap_ddp`` without clipping keeps as the plain run's."""
    found: list[str] = []
    watched: list[tuple[str, str]] = []
    for owner, hook in overriding(trainer, module, GRADIENT_HOOKS):
        if hook not in WRITING_HOOKS:  # on_before_zero_grad: only the gradients differ
            if technique == "optimizer_in_backward":
                found.append(f"{owner}.{hook}")
        elif hooks_read_only_grads and technique == "overlap_ddp" and not clipping:
            watched.append((owner, hook))
        else:
            found.append(f"{owner}.{hook}")
    found += [f"{type(module).__name__}.{name} (an override)"
              for name, techniques in WINDOW_METHODS.items()
              if technique in techniques and is_overridden(name, module)]
    if technique == "optimizer_in_backward" and reads_grads_after_step is not False:
        found += [f"{owner}.{hook}"
                  for owner, hook in overriding(trainer, module, AFTER_STEP_HOOKS)]
    return found, watched


def plain_order_warning(users: list[str], strategy: str, technique: str) -> str:
    """The one warning of a fit whose every step is taken at ``optimizer.step()``
    because of ``users`` (:func:`window_users`)."""
    hints = []
    if any(u.endswith("configure_gradient_clipping (an override)") for u in users):
        hints.append("clip with Trainer(gradient_clip_val=..., gradient_clip_algorithm=...) "
                     "instead of a configure_gradient_clipping override (overlapkit clips "
                     "exactly so during backward)")
    if any(u.endswith((*GRADIENT_HOOKS, "backward (an override)")) for u in users):
        hints.append("read the parameters or the optimizer state in on_train_batch_end "
                     "instead (exact there), and change gradients before they are reduced "
                     "(a hook on the parameter, the loss)")
    after = [u for u in users if u.endswith(AFTER_STEP_HOOKS)]
    if after:
        hints.append(f"pass {strategy}(..., reads_grads_after_step=False) if "
                     f"{', '.join(after)} read{'s' if len(after) == 1 else ''} no .grad, "
                     "or use OverlapDDPStrategy('overlap_ddp') (it keeps the gradients)")
    if any(u.endswith(WRITING_HOOKS) for u in users):
        hints.append("pass OverlapDDPStrategy('overlap_ddp', hooks_read_only_grads=True) "
                     "without gradient_clip_val if on_after_backward / "
                     "on_before_optimizer_step only read .grad")
    if any(u.endswith("optimizer_zero_grad (an override)") for u in users):
        hints.append("leave optimizer_zero_grad to Lightning, or use "
                     "OverlapDDPStrategy('overlap_ddp'), which keeps the gradients")
    return (
        f"{strategy} ({technique}) takes every step of this fit at optimizer.step(), in "
        f"the plain order, without overlap: {', '.join(users)} may work in the window "
        "from a backward to the next zero_grad (read or change .grad before the step, "
        "read the parameters or the optimizer's state before it, read .grad after it, "
        "keep gradients past it), which stepping during backward changes. The run is "
        f"the plain Trainer's, bitwise. To keep the overlap: {'; or '.join(hints)}."
    )


def switch_warning(strategy: str, technique: str, steps: str, why: str, keep: str) -> str:
    """The one warning of a fit turned to the plain order during the fit, for ``steps``
    (``"from the second on"``), saying ``why`` and how to ``keep`` the overlap."""
    return (f"{strategy} ({technique}) takes every step of this fit {steps} at "
            f"optimizer.step(), in the plain order, without overlap: {why}. The run is "
            f"the plain Trainer's, bitwise. To keep the overlap: {keep}.")


def second_backward_error(technique: str) -> ConfigurationError:
    """A second backward before the optimizer step: refused by the gate, or failed in
    autograd (through a graph kept with ``retain_graph=True``, whose saved parameters
    the first backward's step changed in place)."""
    return ConfigurationError(
        "a second backward ran before the optimizer step (LightningModule.backward or "
        f"the closure running more than one backward): {technique} steps the "
        "optimizer during backward, so each backward is one optimizer step, and the "
        "closure of one step may run one (optimizer_in_backward on DDP frees the "
        "gradients of the first, even in the plain order). Nothing was stepped in this "
        "backward. Return one loss from training_step (the sum of several: its backward "
        "is one step, as Lightning's plain step of the accumulated gradients), or train "
        "with strategy='ddp'."
    )


def follow_hooked_loss(automatic: Any, output: Any) -> None:
    """After ``training_step`` (before Lightning's backward, nothing stepped in it): a
    loss returned with a hook on it runs the user's code during Lightning's backward —
    a cached, GradCache-style loss (sentence-transformers' cached losses) runs the
    forward and backward again in chunks there, backwards nested in Lightning's, which
    overlapkit would step as one (the eighth probe, 2 gloo ranks: ``overlap_ddp``
    refused at the second step's ``step()`` after its chunks had stepped, the
    parameters 0.0070 from the start; ``optimizer_in_backward`` refused naming
    ``find_unused_parameters``). ``automatic``'s fit turns to the plain order from this
    step on (bitwise, one warning); where ``optimizer_in_backward`` frees DDP's local
    gradients early (the chunks' sum lost even there), a ConfigurationError, nothing
    stepped. ``automatic``: the strategy's ``AutomaticOptimization``."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if (automatic.optimizer is None or automatic.plain_order
            or not isinstance(loss, torch.Tensor) or not loss._backward_hooks):
        return
    why = ("training_step returned a loss with a hook on it (code run during Lightning's "
           "backward, which may run backwards of its own there: a cached, GradCache-style "
           f"loss, whose backwards {automatic.technique} would step as one)")
    if automatic._freeing_ddp_model is not None:
        raise ConfigurationError(
            f"{why}: optimizer_in_backward on DDP frees each local gradient once DDP has "
            "taken it, so the backwards run there would lose what the plain run "
            "accumulates, even in the plain order. Nothing was stepped. Use "
            "OverlapDDPStrategy(technique='overlap_ddp') (the plain order, bitwise), or "
            "strategy='ddp'.")
    automatic._plain_order_from_now(
        "from this one on", why, "return a loss without a hook on it (backpropagate "
        "through the model from the loss itself)")


class OptimizerChanges:
    """What a fit may change in its optimizer after set-up that no step during backward
    honours, seen before each ``training_step``: a parameter no backward steps (a DDP
    model reduces only those that required grad when it was built, so not one that
    ``add_param_group`` adds later, as ``BackboneFinetuning`` does; optimizer_in_backward
    of a module hooks none of the optimizer's that was frozen at set-up; one of those
    unfrozen on DDP the DDP techniques refuse), or a step hook (``register_step_pre_hook``
    on ``trainer.optimizers[0]``: it would run around each bucket's step). Either turns
    the fit to the plain order, where ``step()`` steps every parameter in one call."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                 ddp: bool) -> None:
        self.optimizer = optimizer  # the adopted one, whose step the engine calls
        self.ready = {id(p) for p in params if p.requires_grad}
        self.at_set_up = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self.ddp = ddp

    def found(self) -> tuple[str, str] | None:
        """Why the fit turns to the plain order, and how to keep the overlap, or None."""
        optimizer = self.optimizer
        if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
            return ("the optimizer has step hooks (registered after trainer.fit() set it "
                    "up), which would run around each part stepped during backward",
                    "log or adjust in on_train_batch_start / on_train_batch_end instead")
        count = sum(1 for g in optimizer.param_groups for p in g["params"]
                    if p.requires_grad and id(p) not in self.ready
                    and (id(p) in self.at_set_up) != self.ddp)
        if not count:
            return None
        return (f"{count} parameter{'s' if count > 1 else ''} the optimizer steps did not "
                "require grad when the fit was set up (unfrozen since, or added by "
                "add_param_group to a DDP model, as BackboneFinetuning does), so no "
                "backward steps them (DDP does not reduce them)",
                "let every trained parameter require grad before trainer.fit() (freeze "
                "by a zero learning rate instead), or fit on one device with "
                "OverlapSingleDeviceStrategy")


#: why a fit turns to the plain order when an ``optimizer_step`` override hands
#: ``optimizer.step()`` a closure of its own (one wrapping Lightning's), and how to keep
#: the overlap: code after the wrapped closure's backward runs in the window (clipping,
#: a change of ``.grad`` or of the learning rate, a read of the parameters)
WRAPPED_CLOSURE = (
    "the optimizer_step override passed optimizer.step() a closure of its own, not "
    "Lightning's optimizer_closure, so its code after that closure's backward may work "
    "in the window before the step (clip or change .grad, change the learning rate, read "
    "the parameters or the optimizer state), which stepping during backward changes",
    "pass optimizer.step(closure=optimizer_closure) as Lightning does; clip with "
    "Trainer(gradient_clip_val=...), and change the learning rate before the closure or "
    "after optimizer.step() returns")


class GradientWrites:
    """Catches a hook that changes ``.grad`` after the backward that already stepped on
    it (``overlap_ddp`` keeps the gradients, so reading them is exact; a change would be
    used by the plain run's step and by nothing here).

    A change is seen by the gradient's version counter (bumped by every in-place write),
    a new ``.grad`` object, or, for a write through ``.data`` (``p.grad.data.mul_(0.5)``,
    which bumps no version counter), by comparing the values with a copy taken before
    the hook (:func:`_differ`): one gradient-sized copy and comparison per step, only
    around the hooks of :data:`WRITING_HOOKS` that the module or a callback overrides.
    """

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], technique: str,
                 hooks: list[tuple[str, str]]) -> None:
        self.named_params = named_params
        self.technique = technique
        self.hooks = {hook: [f"{owner}.{hook}" for owner, h in hooks if h == hook]
                      for _, hook in hooks}

    @contextmanager
    def watching(self, hook: str, stepped: bool, probing: bool = False) -> Iterator[None]:
        """Around Lightning's call of ``hook`` (callbacks and module); checks when a
        backward stepped since the last step, or in the first optimizer step, whose
        backwards are deferred (``probing``: nothing has stepped yet, and the change is
        refused before anything does)."""
        owners = self.hooks.get(hook)
        if not (stepped or probing) or not owners:
            yield
            return
        before = [(name, p, p.grad, None if p.grad is None else p.grad._version)
                  for name, p in self.named_params]
        # a write through .data bumps no version counter: the values are compared too
        copies = [(name, grad, grad.detach().clone()) for name, _, grad, _ in before
                  if grad is not None]
        reads, params = _ParameterReads(), [p for _, p in self.named_params]
        watched = watched_class() if probing else None
        if watched is not None:  # nothing stepped yet: a read of them is the plain one
            watch_params(params, watched, reads)
        try:
            yield
        finally:
            if watched is not None:
                unwatch_params(params, watched)
        if reads.params:
            names = {id(p): name for name, p in self.named_params}
            read = [names[key] for key in reads.params]
            raise ConfigurationError(
                f"{' or '.join(owners)} read the values of {read[0]!r}"
                f"{f' (and {len(read) - 1} more)' if len(read) > 1 else ''} before the "
                "optimizer step, though hooks_read_only_grads=True said the hooks only "
                f"read gradients: from the second step on {self.technique} steps during "
                "backward, before this hook runs, so it would read that step's update "
                "already, where the plain run's hook reads the values before it. Nothing "
                "was stepped (the first optimizer step checks for this before it steps). "
                "Leave hooks_read_only_grads out (the fit is then stepped in the plain "
                "order), or read the parameters after the step (on_train_batch_end).")
        changed = [name for name, p, grad, version in before
                   if p.grad is not grad or (grad is not None and grad._version != version)]
        changed = changed or _differ(copies)
        if changed:
            when = ("Nothing was stepped (the first optimizer step checks for this before "
                    "it steps)" if probing else
                    f"{self.technique} had already stepped on it during backward, so the "
                    "change was not used")
            raise ConfigurationError(
                f"{' or '.join(owners)} changed the gradient of {changed[0]!r}"
                f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''} after "
                f"backward, though hooks_read_only_grads=True said the hooks only read "
                f"gradients: {self.technique} steps during backward, before this hook "
                "runs, so such a change cannot be used, where the plain run's step would "
                f"use it. {when}. Leave hooks_read_only_grads out (the fit is then "
                "stepped in the plain order, the change honoured), or change gradients "
                "before they are reduced and stepped (a hook on the parameter, the loss)."
            )


class _ParameterReads:
    """The parameters a hook read in the probe step
    (:mod:`~overlapkit.overlap.core.watched_params`)."""

    def __init__(self) -> None:
        self.params: list[int] = []

    def note_param_read(self, param: torch.Tensor) -> None:
        if id(param) not in self.params:
            self.params.append(id(param))


def _differ(kept: list[tuple[str, torch.Tensor, torch.Tensor]]) -> list[str]:
    """The names whose gradient is no longer bitwise its copy (NaN where the copy had
    NaN counts as the same), seen with one host synchronisation for all of them."""
    if not kept:
        return []
    flags = torch.stack([((grad != copy) & ~(grad.isnan() & copy.isnan())).any()
                         for _, grad, copy in kept]).cpu()
    return [name for (name, _, _), flag in zip(kept, flags.tolist(), strict=True) if flag]
