"""Post-local SGD and DiLoCo under a torchft ``Manager``: a lost replica costs no progress.

:func:`local_sgd` returns a :class:`FaultTolerantLocalSGD`, the
:class:`~overlapkit.PostLocalSGDOptimizer` of :func:`overlapkit.post_local_sgd` whose
averager averages over the replica groups of the manager's quorum
(:class:`~overlapkit.ft.ManagedReplicas`). torchft is the engine and overlapkit adds
no fault-tolerance machinery of its own; at each averaging step:

1. ``manager.start_quorum()``: the Lighthouse names the live replica groups, torchft
   reconfigures its process group over them, and a group that is behind (restarted
   after a kill) recovers live from a peer: the model, the local optimizer and the
   averager's state (DiLoCo's round start and outer momentum), sent by torchft's
   checkpoint transport, no file read;
2. the averager averages over the quorum, with the arithmetic it uses on a process
   group (so a run with no failure is bitwise the run without torchft);
3. ``manager.should_commit()``: if a replica failed during the averaging, the
   parameters and the averager go back to what they were before it, the step is
   still counted, and the next averaging comes ``period`` steps later.

Between averaging steps nothing talks to torchft: the local steps run at full speed.
With Streaming DiLoCo's ``fragment_sync_delay`` the quorum and the (asynchronous)
allreduce come at the step the sync starts, and the commit decision at its outer step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from overlapkit.errors import (
    ConfigurationError,
    MissingDependencyError,
    OverlapkitError,
    QuorumError,
    UnsupportedModelError,
    UnsupportedOptimizerError,
)
from overlapkit.ft.replicas import ManagedReplicas
from overlapkit.local_sgd.averagers import ModelAverager, check_period, check_warmup_steps
from overlapkit.local_sgd.optimizer import PostLocalSGDOptimizer
from overlapkit.overlap.core.eager_steps import run_eagerly_when_compiled
from overlapkit.plugin.manager import get_plugin_manager

__all__ = ["STATE_DICT_KEY", "FaultTolerantLocalSGD", "local_sgd"]

#: the key under which the optimizer registers the model's and its own state with the
#: manager, for a recovering replica group to load
STATE_DICT_KEY = "overlapkit.local_sgd"


class FaultTolerantLocalSGD(PostLocalSGDOptimizer):
    """A :class:`~overlapkit.PostLocalSGDOptimizer` whose averaging steps go through a
    torchft ``Manager``: a quorum, the averaging over it, then the commit decision.
    Build it with :func:`local_sgd`.

    :raises QuorumError: from :meth:`step`, when the quorum cannot be formed.
    :ivar commits: averaging steps committed by this replica group.
    :ivar failed_commits: averaging steps rolled back (a replica failed during them).
    """

    def __init__(
        self, manager: Any, model: torch.nn.Module, optim: torch.optim.Optimizer,
        averager: ModelAverager,
    ) -> None:
        super().__init__(optim, averager)
        self.manager = manager
        self.model = model
        self.commits = 0
        self.failed_commits = 0
        manager.register_state_dict_fn(STATE_DICT_KEY, self._load_recovered,
                                       self._state_for_recovery)

    def __repr__(self) -> str:
        return f"FaultTolerantLocalSGD({self.optim!r}, averager={self.averager!r})"

    def _phases_now(self) -> tuple[bool, bool]:
        """Whether this step starts a quorum and whether it commits: both at an
        averaging step, apart for an averager whose sync overlaps the steps between
        (Streaming DiLoCo's ``fragment_sync_delay``: the quorum and the allreduce
        start at ``sync_starts_at``, the commit comes at ``sync_ends_at``)."""
        averager = self.averager
        step = averager.step
        if step < averager.warmup_steps or averager.group_for_step(step) is None:
            return False, False
        starts, ends = (getattr(averager, name, None)
                        for name in ("sync_starts_at", "sync_ends_at"))
        if starts is None or ends is None:
            return True, True
        return bool(starts(step)), bool(ends(step))

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Step the local optimizer (torchft may not read the state meanwhile), then,
        on an averaging step, run the quorum, the averaging and the commit decision.
        Returns the closure's loss, if any."""
        self.manager.disallow_state_dict_read()
        try:
            self.averager.before_step(self.param_groups)
            loss = self.optim.step(closure) if closure is not None else self.optim.step()
        finally:
            self.manager.allow_state_dict_read()
        starts, commits = self._phases_now()
        if starts or commits:
            self._average_over_quorum(starts, commits)
        else:
            self.averager.average_parameters(self.param_groups)  # counts the step
        return loss

    def _average_over_quorum(self, starts: bool, commits: bool) -> None:
        if starts:
            self._start_quorum()
            if self._phases_now() != (starts, commits):
                raise OverlapkitError(
                    f"after recovering from a peer this replica group is at step "
                    f"{self.averager.step}, not an averaging step of {self.averager!r}: the "
                    "replica groups were built with different periods or warm-ups. Build "
                    "every replica group's optimizer with the same local_sgd arguments."
                )
        if not commits:  # the sync is in flight; it commits fragment_sync_delay steps on
            self.averager.average_parameters(self.param_groups)
            return
        params = [p for group in self.param_groups for p in group["params"]]
        with torch.no_grad():
            before = [p.detach().clone() for p in params]
        averager_before = copy.deepcopy(self.averager.state_dict())
        # a sync in flight (DiLoCo's) is the one this averaging applies: not restored
        averager_before.pop("in_flight", None)
        self.averager.average_parameters(self.param_groups)
        if self.manager.should_commit():
            self.commits += 1
            return
        # A replica failed during the averaging: undo it, count the step.
        with torch.no_grad():
            for param, saved in zip(params, before, strict=True):
                param.copy_(saved)
        step = self.averager.step
        self.averager.load_state_dict(averager_before)
        self.averager.step = step
        self.failed_commits += 1

    def _start_quorum(self) -> None:
        try:
            self.manager.start_quorum()  # a replica group that is behind recovers here
        except Exception as failed:  # torchft's (a Rust RuntimeError, a timeout, ...)
            raise QuorumError(
                f"the torchft quorum of averaging step {self.averager.step} failed: "
                f"{failed}. Check that the Lighthouse (the manager's lighthouse_addr, or "
                "TORCHFT_LIGHTHOUSE) is up, that at least its min_replicas replica groups "
                "reach it within the manager's quorum_timeout, and raise quorum_timeout "
                "above the time of `period` steps. This step's local update was applied, "
                "its averaging was not; the next step() averages again."
            ) from failed

    def _state_for_recovery(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.state_dict()}

    def _load_recovered(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.load_state_dict(state["optimizer"])


def _require_manager(manager: object) -> None:
    try:
        from torchft.manager import Manager
    except ImportError as missing:
        raise MissingDependencyError(
            "overlapkit.ft.local_sgd runs on torchft, which is not installed; install "
            "the extra: pip install 'overlapkit[ft]' (torchft 0.2.0)."
        ) from missing
    if not isinstance(manager, Manager):
        raise ConfigurationError(
            f"overlapkit.ft.local_sgd needs a torchft.Manager, got "
            f"{type(manager).__name__}; build one per replica group: "
            "torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=1, "
            "use_async_quorum=False, load_state_dict=None, state_dict=None, ...)."
        )
    if getattr(manager, "_use_async_quorum", False):
        raise ConfigurationError(
            "overlapkit.ft.local_sgd needs a Manager built with use_async_quorum=False: "
            "with an asynchronous quorum a recovering replica loads its peer's state "
            "after the averaging, which would overwrite it. Pass use_async_quorum=False "
            "(the quorum only runs at averaging steps, so it costs little)."
        )
    registered = getattr(manager, "_user_state_dicts", {})
    if STATE_DICT_KEY in registered:
        raise ConfigurationError(
            f"this Manager already serves a local_sgd optimizer (its state is registered "
            f"as {STATE_DICT_KEY!r}); build one Manager per optimizer."
        )


def local_sgd(
    manager: Any,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    *,
    period: int,
    warmup_steps: int = 0,
    averager: str = "periodic",
    **averager_options: Any,
) -> FaultTolerantLocalSGD:
    """Set up post-local SGD (or DiLoCo, ``averager="diloco"``) over the replica groups
    of a torchft ``manager``, and return the optimizer to step.

    Each replica group steps ``optim`` on its own data; every ``period`` steps (after
    ``warmup_steps`` steps without averaging) the averager averages over the live
    replica groups. A replica group killed mid-run drops out of the next quorum and the
    others keep stepping; restarted, it recovers the model, ``optim``'s state and the
    averager's state live from a peer at its first averaging step. The optimizer
    registers that state with ``manager`` itself: build the manager with
    ``load_state_dict=None, state_dict=None`` (or for other state of yours).

    The schedule is :class:`~overlapkit.local_sgd.averagers.PeriodicAverager`'s: the
    first averaging after step ``warmup_steps + 1``, then every ``period`` steps.
    torchft's ``LocalSGD(sync_every=period)`` averages after steps ``period``,
    ``2 * period``, ...: ``warmup_steps=period - 1`` gives its schedule. DiLoCo's
    outer step comes after the ``period``-th inner step of each round, as in torchft's
    ``DiLoCo(sync_every=period)``.

    :param manager: a ``torchft.Manager`` built with ``use_async_quorum=False``, one
        per replica group.
    :param model: the model ``optim`` trains (its state goes to a recovering peer).
    :param optim: the local optimizer over the model's parameters.
    :param period: steps between two averagings (DiLoCo: inner steps per round).
    :param warmup_steps: steps before the first averaging (or the first round).
    :param averager: ``"periodic"``, or a plugin's averager such as ``"diloco"``.
    :param averager_options: passed on to the averager, e.g. ``outer_lr=0.7``.
    :raises MissingDependencyError: torchft is not installed.
    :raises ConfigurationError: not a torchft Manager, an asynchronous quorum, a bad
        period or warm-up, the hierarchical averager, or parameters outside ``model``.
    :raises UnknownNameError: no plugin provides the averager.
    """
    _require_manager(manager)
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(
            f"overlapkit.ft.local_sgd needs the model as a torch.nn.Module, got "
            f"{type(model).__name__}; pass the module the optimizer trains."
        )
    if not isinstance(optim, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"overlapkit.ft.local_sgd needs an optimizer instance, got "
            f"{type(optim).__name__}; pass e.g. torch.optim.SGD(model.parameters(), lr=0.1)."
        )
    check_period(period)
    check_warmup_steps(warmup_steps)
    if averager == "hierarchical":
        raise ConfigurationError(
            "the hierarchical averager averages over subgroups of a torch.distributed "
            "process group; torchft's quorum is one level of replica groups. Use "
            "averager='periodic' or 'diloco'."
        )
    if "process_group" in averager_options:
        raise ConfigurationError(
            "overlapkit.ft.local_sgd averages over the manager's quorum; remove "
            "process_group from the averager options."
        )
    in_model = {id(p) for p in model.parameters()}
    outside = sum(1 for g in optim.param_groups for p in g["params"] if id(p) not in in_model)
    if outside:
        raise ConfigurationError(
            f"{outside} of the optimizer's parameters are not the model's, so a recovering "
            "replica group could not receive them; build the optimizer over "
            "model.parameters()."
        )
    spec = get_plugin_manager().registry.averager(averager)
    built = spec.create(period=period, warmup_steps=warmup_steps,
                        process_group=ManagedReplicas(manager), **averager_options)
    if not isinstance(built, ModelAverager):
        raise ConfigurationError(
            f"the {averager!r} averager is a {type(built).__name__}, not an overlapkit "
            "ModelAverager, so its averaging steps cannot be known ahead for the quorum; "
            "subclass overlapkit.plugin.ModelAverager."
        )
    return FaultTolerantLocalSGD(manager, model, optim, built)


# called from a torch.compile'd function, step() runs eagerly (overlap/core/eager_steps.py)
run_eagerly_when_compiled(FaultTolerantLocalSGD, "step")
