"""Post-local SGD: local optimizer steps with periodic model averaging, resumable.

:func:`post_local_sgd` sets the technique up on a DDP model in one call: it registers
the ``post_local_sgd`` comm hook (global gradient averaging during warm-up, within a
subgroup after) and returns a :class:`PostLocalSGDOptimizer` that steps the local
optimizer and then lets a model averager average the parameters every ``period``
steps. Both counters, the hook's warm-up iterations and the averager's steps, live
in the optimizer's ``state_dict()``, so a run resumed from a checkpoint continues
exactly where it stopped.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.errors import (
    CheckpointError,
    ConfigurationError,
    UnsupportedModelError,
    UnsupportedOptimizerError,
)
from overlapkit.ft.refusals import refuse_torchft_ddp
from overlapkit.local_sgd.averagers import (
    ModelAverager,
    check_averager,
    check_period,
    check_warmup_steps,
    declares_before_step,
)
from overlapkit.local_sgd.averaging import ReplicaGroup
from overlapkit.local_sgd.comm_hook import (
    PostLocalSGDHookState,
    agreed_default_subgroup_size,
    build_post_local_sgd_hook,
    check_subgroup_size,
    overlapped_hook_state,
)
from overlapkit.local_sgd.failures import (
    averaging_failures,
    load_averager_state,
    refuse_after_failure,
    restore_averager_state,
    saved_averager_state,
)
from overlapkit.local_sgd.first_step import LearnsFirstStep
from overlapkit.local_sgd.plugin import create_averager
from overlapkit.local_sgd.watched_collectives import install as install_watched_collectives
from overlapkit.optimizer_wrapper import OptimizerWrapper
from overlapkit.overlap.core.watched_reads import quiet_reads
from overlapkit.plugin.manager import get_plugin_manager

__all__ = ["PostLocalSGDOptimizer", "create_averager", "post_local_sgd"]


class PostLocalSGDOptimizer(LearnsFirstStep, OptimizerWrapper):
    """Step a local optimizer, then let a model averager average the parameters.

    torch's ``PostLocalSGDOptimizer``, fixed: it is a full ``torch.optim.Optimizer``
    (an :class:`~overlapkit.OptimizerWrapper`: LR schedulers and step hooks work;
    ``param_groups`` and ``state`` are the local optimizer's, live); ``step`` takes a
    closure; its ``state_dict()`` keeps the local optimizer's format and adds the
    averager's whole state (not only its step) and, when it knows the comm hook's state,
    the hook's warm-up counter.

    :param optim: the local optimizer; it steps every iteration.
    :param averager: a :class:`~overlapkit.local_sgd.averagers.ModelAverager` (or any object
        with ``average_parameters(params)``, ``step``, ``state_dict()`` and
        ``load_state_dict()``), e.g. from :func:`create_averager`.
    :param comm_hook_state: the ``post_local_sgd`` comm hook's state when the hook was
        registered by hand (``build_comm_hook("post_local_sgd", ...)``), so that its
        counter is saved and restored too; :func:`post_local_sgd` passes it for you.
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager, *,
                 comm_hook_state: PostLocalSGDHookState | None = None) -> None:
        if not isinstance(optim, torch.optim.Optimizer):
            raise UnsupportedOptimizerError(
                f"PostLocalSGDOptimizer wraps an optimizer instance, got {type(optim).__name__}"
                "; pass e.g. torch.optim.SGD(model.parameters(), lr=0.1).")
        check_averager(averager)
        super().__init__(optim)
        self.averager = averager
        install_watched_collectives()  # an averager's own collectives: failures told
        # overlap_ddp(..., comm_hook="post_local_sgd"): its hook's, saved and restored
        self.comm_hook_state = (comm_hook_state if comm_hook_state is not None
                                else overlapped_hook_state(optim))
        learn_first_step = getattr(optim, "learn_first_step", None)
        #: the local optimizer's next step is deferred to step() for before_step
        self._first_step_deferred = False
        if getattr(averager, "before_step", None) is not None and learn_first_step:
            # An overlapped local optimizer steps during backward, before step() calls
            # the averager's before_step (DiLoCo's round start before the first step:
            # 0.4.0 took it after that step, 0.030 off the paper after 12 steps): its first step
            # is taken at step() instead, in the plain order (and the loop learnt); a later
            # one too where the averager's before_step_at says it uses the parameters;
            # without before_step_at, every step (9b5962c: only warned, 0.008 off).
            if declares_before_step(averager):
                learn_first_step()
            else:
                warnings.warn(
                    f"{type(averager).__name__} has before_step but no before_step_at(step), "
                    "so overlapkit cannot tell before which steps it uses the parameters: "
                    f"{type(optim).__name__} takes every step at step(), in the plain order, "
                    "without overlap. Define before_step_at(step) -> bool on the averager "
                    "(True where before_step reads or writes the parameters) to keep the "
                    "other steps overlapped.", UserWarning, stacklevel=2)
                learn_first_step(plain_order=True)
            self._first_step_deferred = True

    @property
    def optim(self) -> torch.optim.Optimizer:
        """The local optimizer (the wrapped one)."""
        return self.wrapped

    def __repr__(self) -> str:
        return f"PostLocalSGDOptimizer({self.optim!r}, averager={self.averager!r})"

    def checkpoint_refusal(self, *, loading: bool = False) -> str:
        """Always a reason: :mod:`overlapkit.checkpoint` saves the real optimizer's
        state and one copy (rank 0's) of what DDP replicates, so it would lose the
        averager's and the comm hook's counters (a resumed run would re-run warm-up)
        and, after warm-up, every other rank's own parameters and optimizer state."""
        return (
            "a PostLocalSGDOptimizer cannot go into an overlapkit checkpoint: it keeps "
            "one copy of the DDP model and the real optimizer's state only, so the "
            "averager's and the comm hook's counters and, after warm-up, each rank's "
            "own parameters and optimizer state would be lost. Save each rank's own: "
            "torch.save({'model': ddp_model.state_dict(), 'optimizer': opt.state_dict()}, "
            "f'ckpt-rank{rank}.pt'), and resume with load_state_dict on each."
        )

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Step the local optimizer, then count a step on the averager (which averages all
        parameters on its averaging steps); returns the closure's loss, if any. Compiled, the
        local step is compiled as a plain optimizer's; the averager's work runs eagerly."""
        self._before_local_step()
        loss = self.optim.step(closure) if closure is not None else self.optim.step()
        self._after_local_step()
        return loss

    def _before_local_step(self) -> None:
        refuse_after_failure()  # an averaging failed on some rank: out of step
        before_step = getattr(self.averager, "before_step", None)
        if before_step is not None:
            # before a deferred step its read is the plain one (not the loop's use of the
            # window); a later read is warned of (ParameterReadInWindowWarning)
            deferred, self._first_step_deferred = self._first_step_deferred, False
            with quiet_reads() if deferred else contextlib.nullcontext():
                before_step(self.param_groups)

    def _after_local_step(self) -> None:
        """Average; an overlapped local optimizer's next step at step() if before_step_at."""
        with averaging_failures(self.averager):
            self.averager.average_parameters(self.param_groups)
        defer = getattr(self.optim, "defer_next_step", None)
        if (defer is not None and declares_before_step(self.averager)
                and self.averager.before_step_at(self.averager.step)
                and not getattr(self.optim, "steps_in_plain_order", False)):
            defer()  # the names and loop_clips learn_first_step was given kept
            self._first_step_deferred = True

    def state_dict(self) -> dict[str, Any]:
        """The local optimizer's ``state_dict()`` plus:

        - ``"averager"``: the averager's whole ``state_dict()``;
        - ``"step"``: the averager's step, the key torch's ``PostLocalSGDOptimizer``
          reads, so checkpoints load into either;
        - ``"comm_hook"``: the comm hook state's ``state_dict()``, when known;
        - ``"world_size"``: the size of the averager's process group, so that state
          saved after local steps began (each rank's own) is not loaded at another
          world size (see :meth:`load_state_dict`).
        """
        state_dict = self.optim.state_dict()
        state_dict["averager"] = saved_averager_state(self.averager)
        state_dict["step"] = self.averager.step
        if self.comm_hook_state is not None:
            state_dict["comm_hook"] = self.comm_hook_state.state_dict()
        world_size = self._world_size()
        if world_size is not None:
            state_dict["world_size"] = world_size
        return state_dict

    def _world_size(self) -> int | None:
        if not dist.is_available() or not dist.is_initialized():
            return None
        group = getattr(self.averager, "process_group", None)
        if isinstance(group, ReplicaGroup):
            return None  # a torchft quorum: its size changes as replicas fail and rejoin
        return int(dist.get_world_size(group))

    def _check_world_size(self, state_dict: Mapping[str, Any]) -> None:
        """Refuse state saved after local steps began at another world size: from then
        on each rank's parameters and optimizer state are its own, and no rank of the
        new world has a state of its own to load (during warm-up every rank's state is
        the same, and loads anywhere)."""
        saved, here = state_dict.get("world_size"), self._world_size()
        if not isinstance(saved, int) or here is None or saved == here:
            return
        averager = state_dict.get("averager")
        step = averager.get("step") if isinstance(averager, Mapping) else state_dict.get("step")
        warmup = getattr(self.averager, "warmup_steps", None)
        if isinstance(step, int) and isinstance(warmup, int) and step <= warmup:
            return
        raise CheckpointError(
            f"this state was saved by one of {saved} ranks after local SGD began (step "
            f"{step}, warm-up {warmup}), where each rank's parameters and optimizer state "
            f"are its own: it cannot be resharded to {here} ranks. Resume at {saved} ranks "
            f"(torchrun with {saved} ranks in all), or start the new shape from a "
            "checkpoint saved during warm-up. Nothing was loaded."
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the local optimizer, the averager and the comm hook counter.

        A checkpoint of torch's ``PostLocalSGDOptimizer`` (only ``"step"``) restores the
        averager's step. Without an averager entry a warning is raised and the averager
        keeps its current state. Without a comm hook entry the hook's counter is
        inferred from the averager's step (one backward per step), with a warning.

        All or nothing: if any entry is refused, the optimizer, the averager and the
        comm hook are left exactly as they were.

        :raises CheckpointError: ``state_dict`` is not a dict, lacks ``state`` or
            ``param_groups``, or its averager or comm hook entry is not valid; or it
            was saved after local SGD began by a process group of another size (each
            rank's state is its own then: it cannot be resharded).
        """
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(
                f"load_state_dict: state_dict must be a dict, got "
                f"{type(state_dict).__name__}; pass what PostLocalSGDOptimizer."
                "state_dict() returned. Nothing was loaded."
            )
        for key in ("averager", "comm_hook"):
            if key in state_dict and not isinstance(state_dict[key], Mapping):
                raise CheckpointError(
                    f"the state dict's {key!r} entry is a {type(state_dict[key]).__name__}, "
                    "not a dict; load the state_dict() of a PostLocalSGDOptimizer. "
                    "Nothing was loaded."
                )
        # All or nothing, and the optimizer last: torch's load_state_dict checks the
        # groups before it changes anything, so the averager and the comm hook (a
        # counter each) load first, and are put back if a later part refuses its
        # entry; the optimizer's state is only replaced once everything else loaded.
        self._check_world_size(state_dict)
        before = (saved_averager_state(self.averager),
                  None if self.comm_hook_state is None else self.comm_hook_state.state_dict())
        try:
            self._load_averager_and_hook(state_dict)
            try:
                self.optim.load_state_dict(state_dict)
            except ValueError as refused:  # torch's: other group count or sizes
                raise CheckpointError(
                    f"the state dict does not fit the local optimizer ({refused}); load "
                    "the state_dict() of a PostLocalSGDOptimizer over the same parameter "
                    "groups. Nothing was loaded."
                ) from refused
        except BaseException:
            restore_averager_state(self.averager, before[0])
            if self.comm_hook_state is not None and before[1] is not None:
                self.comm_hook_state.load_state_dict(before[1])
            raise

    def _load_averager_and_hook(self, state_dict: dict[str, Any]) -> None:
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise CheckpointError(
                    f"the state dict has no {key!r} entry; load the state_dict() of a "
                    "PostLocalSGDOptimizer (or of its local optimizer). Nothing was loaded."
                )
        if "averager" in state_dict:
            load_averager_state(self.averager, state_dict["averager"])
        elif "step" in state_dict:
            load_averager_state(self.averager, {"step": state_dict["step"]})
        else:
            warnings.warn(
                "the loaded state dict has no 'averager' (or 'step') entry, so the model "
                f"averager keeps its current step {self.averager.step}; with fewer steps "
                "than warm-up, warm-up runs again. Save with PostLocalSGDOptimizer."
                "state_dict() to resume exactly.", UserWarning, stacklevel=3,
            )
        hook = self.comm_hook_state
        if hook is None:
            return
        if "comm_hook" in state_dict:
            hook.load_state_dict(state_dict["comm_hook"])
        else:
            hook.iter = min(int(self.averager.step), hook.start_localSGD_iter)
            warnings.warn(
                "the loaded state dict has no 'comm_hook' entry; the post-local-SGD comm "
                f"hook's warm-up counter is set from the averager's step to {hook.iter} "
                f"(of {hook.start_localSGD_iter}).", UserWarning, stacklevel=3,
            )


def post_local_sgd(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    optim: torch.optim.Optimizer,
    *,
    period: int,
    warmup_steps: int,
    averager: str = "periodic",
    subgroup_size: int | None = None,
    **averager_options: Any,
) -> PostLocalSGDOptimizer:
    """Set up post-local SGD on ``ddp_model`` and return the optimizer to step.

    For ``warmup_steps`` steps DDP averages gradients over its whole process group;
    then only within subgroups of ``subgroup_size`` consecutive ranks, and the
    averager averages the parameters over the whole group every ``period`` steps.

    A collective (it creates subgroups): call it on every rank, with the same
    arguments, after ``init_process_group``.

    :param ddp_model: a ``DistributedDataParallel`` model without a comm hook.
    :param optim: the local optimizer over the model's parameters.
    :param period: steps between two global averagings (for ``hierarchical``, the
        largest period of ``period_group_size_dict``).
    :param warmup_steps: steps of plain DDP before local SGD starts.
    :param averager: a registered averager name. ``"hierarchical"`` without
        ``period_group_size_dict`` takes its levels from the launch: each node averages
        every ``node_period`` steps (an averager option, default ``period // 4``), all
        ranks every ``period`` steps (see ``docs/nodes.rst``).
    :param subgroup_size: ranks per subgroup; default: the launcher's
        ``LOCAL_WORLD_SIZE`` (one subgroup per node; the same on every rank), else 1
        with a warning; 1 for ``hierarchical`` with levels from the launch (each rank
        steps alone between averagings).
    :param averager_options: passed on to the averager, e.g.
        ``period_group_size_dict`` or ``node_period`` for ``hierarchical``.
    :raises UnsupportedModelError: ``ddp_model`` is not a DDP model.
    :raises ConfigurationError: a bad period, warm-up, subgroup size or averager
        option, or a comm hook already registered on the model.
    :raises UnknownNameError: no plugin provides the averager.
    """
    refuse_torchft_ddp(type(ddp_model), "post_local_sgd")
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise UnsupportedModelError(
            f"post_local_sgd needs a DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}; wrap it: DistributedDataParallel(model)."
        )
    if not isinstance(optim, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"post_local_sgd needs an optimizer instance, got {type(optim).__name__}; pass "
            "e.g. torch.optim.SGD(ddp_model.parameters(), lr=0.1)."
        )
    check_period(period)
    check_warmup_steps(warmup_steps)
    for reserved in ("warmup_steps", "process_group"):
        if reserved in averager_options:
            raise ConfigurationError(
                f"post_local_sgd sets the averager's {reserved} itself; remove it from the "
                "averager options."
            )
    registry = get_plugin_manager().registry
    averager_spec = registry.averager(averager)
    group: dist.ProcessGroup = ddp_model.process_group
    if subgroup_size is not None:
        size = check_subgroup_size(subgroup_size, group.size())
    elif averager == "hierarchical" and averager_options.get("period_group_size_dict") is None:
        # Levels from the launch: the averager's node level replaces a per-step gradient
        # allreduce within the node (with it, a node's ranks would hold the same
        # parameters and the node level would average nothing).
        size = 1
    else:
        size = agreed_default_subgroup_size(group)
    options = {"period": period, "warmup_steps": warmup_steps, "process_group": group,
               **averager_options}
    model_averager = averager_spec.create(**options)
    check_averager(model_averager, averager)  # before the hook changes the model
    # Built directly, not looked up: post_local_sgd needs exactly this hook (its state
    # is what the optimizer saves), so no plugin could stand in for it.
    hook_state, hook = build_post_local_sgd_hook(
        process_group=group, start_localSGD_iter=warmup_steps, subgroup_size=size
    )
    try:
        ddp_model.register_comm_hook(hook_state, hook)
    except RuntimeError as exc:
        raise ConfigurationError(
            f"could not register the post_local_sgd comm hook: {str(exc).rstrip('.')}. "
            "A DDP model takes one comm hook; build a fresh DistributedDataParallel for "
            "post_local_sgd."
        ) from exc
    return PostLocalSGDOptimizer(optim, model_averager, comm_hook_state=hook_state)

