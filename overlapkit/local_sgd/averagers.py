"""Model averagers for post-local SGD: periodic and hierarchical.

A model averager is called once per optimizer step, after the local step, and every so
often replaces each parameter by its mean over a process group. The averagers here
follow torch's ``PeriodicModelAverager`` and ``HierarchicalModelAverager`` (the same
schedule, the same arithmetic, bitwise the same results) and fix three things that
users of torch's hit:

- which parameters are averaged is torch's rule (those with a gradient at this step),
  so the flat buffer and the results are bitwise torch's on any number of ranks;
  integer parameters (which torch would fail to average), frozen ones and unused ones
  are left out. The ranks agree on the choice first, so a parameter with a gradient
  on some ranks only is averaged everywhere, where torch sums mismatched slices of
  its flat buffers (a silent accuracy loss, pytorch #74157). Where torch fails — no
  parameter has a gradient, e.g. after ``zero_grad(set_to_none=True)`` — every
  floating-point parameter that can learn is averaged instead (see :func:`parameters_to_average`);
- their state (the step counter, and whatever a subclass keeps) is saved and restored
  with :meth:`ModelAverager.state_dict` / :meth:`ModelAverager.load_state_dict`, so a
  resumed run neither re-runs warm-up nor shifts its averaging schedule (pytorch
  #74556);
- bad arguments raise :class:`~overlapkit.errors.ConfigurationError` before any
  process group is created.

Write a new averager (DiLoCo, SlowMo, ...) by subclassing :class:`ModelAverager` and
registering it through ``overlapkit_register_averagers``; see
``docs/post_local_sgd.rst`` for the interface.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.errors import CheckpointError, ConfigurationError
from overlapkit.local_sgd.averaging import ReplicaGroup, average_in_place, parameters_to_average
from overlapkit.local_sgd.hierarchy import check_plan_follows_nodes
from overlapkit.nodes import node_layout

__all__ = [
    "HierarchicalAverager",
    "ModelAverager",
    "PeriodicAverager",
    "ReplicaGroup",
    "average_in_place",
    "check_averager",
    "declares_before_step",
    "parameters_to_average",
    "validate_period_group_sizes",
]


def _positive_int(name: str, value: object, what_to_do: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be an integer >= 1, got {value!r}; {what_to_do}")
    return value


def _non_negative_int(name: str, value: object, what_to_do: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"{name} must be an integer >= 0, got {value!r}; {what_to_do}")
    return value


def check_warmup_steps(value: object) -> int:
    """``value`` as a warm-up step count, or a ConfigurationError saying what to pass."""
    return _non_negative_int(
        "warmup_steps", value, "pass the number of steps of global gradient averaging "
        "before local SGD starts (0 for none)."
    )


def check_period(value: object) -> int:
    """``value`` as an averaging period, or a ConfigurationError saying what to pass."""
    return _positive_int(
        "period", value, "pass how many optimizer steps go between two averagings "
        "(e.g. 4; 1 averages every step, which costs more than plain DDP)."
    )


def _require_initialized(what: str) -> None:
    if not dist.is_initialized():
        raise ConfigurationError(
            f"{what} needs torch.distributed; call torch.distributed.init_process_group() "
            "first (torchrun sets up the environment it reads)."
        )


def check_averager(averager: Any, built_as: str | None = None) -> None:
    """A ConfigurationError unless ``averager`` has what PostLocalSGDOptimizer drives
    (``built_as``: the name whose builder returned it)."""
    missing = [m for m in ("average_parameters", "state_dict", "load_state_dict")
               if not callable(getattr(averager, m, None))]
    if not missing and hasattr(averager, "step"):
        return
    lacks, what = f"(it lacks {missing or ['step']})", type(averager).__name__
    if built_as is None:
        raise ConfigurationError(f"{what} is not a model averager {lacks}; build one "
                                 "with overlapkit.create_averager(name, ...).")
    raise ConfigurationError(
        f"the builder of the averager {built_as!r} returned a {type(averager).__name__}, "
        f"not a model averager {lacks}; the plugin's builder must return the averager "
        "(a ModelAverager). Nothing was set up.")


def declares_before_step(averager: Any) -> bool:
    """Whether ``averager`` says before which steps its ``before_step`` uses the
    parameters (not a subclass overriding ``before_step`` alone)."""
    if not callable(getattr(averager, "before_step_at", None)):
        return False
    cls = type(averager)
    return not (isinstance(averager, ModelAverager)
                and cls.before_step is not ModelAverager.before_step
                and cls.before_step_at is ModelAverager.before_step_at)


class ModelAverager(abc.ABC):
    """Base class of overlapkit's model averagers: the interface post-local SGD drives.

    :class:`~overlapkit.PostLocalSGDOptimizer` calls :meth:`average_parameters` once
    per optimizer step, right after the local step, and saves :meth:`state_dict` in
    its own ``state_dict()``. A subclass says *when* and *over which group* to average
    by implementing :meth:`group_for_step`, and may change *how* by overriding
    :meth:`average` (an outer optimizer step, compression, ...). An averager that
    keeps state of its own (momentum buffers, round-start parameters) extends
    :meth:`state_dict` and :meth:`load_state_dict`, calling ``super()``.

    :param warmup_steps: steps during which no averaging happens (DDP averages the
        gradients globally then).
    :param process_group: the group the averaging spans at its top level
        (``None``: the default group, resolved when used).
    """

    #: optimizer steps seen so far: the number of :meth:`average_parameters` calls.
    step: int
    #: steps before the first averaging (no averaging while ``step < warmup_steps``).
    warmup_steps: int

    def __init__(
        self, *, warmup_steps: int = 0,
        process_group: dist.ProcessGroup | ReplicaGroup | None = None,
    ) -> None:
        self.warmup_steps = check_warmup_steps(warmup_steps)
        self._process_group = process_group
        self.step = 0

    @property
    def process_group(self) -> dist.ProcessGroup | ReplicaGroup:
        """The top-level group (the default group when none was given)."""
        if self._process_group is not None:
            return self._process_group
        _require_initialized(type(self).__name__)
        group = dist.group.WORLD
        assert group is not None
        return group

    @abc.abstractmethod
    def group_for_step(self, step: int) -> dist.ProcessGroup | ReplicaGroup | None:
        """The group to average over after optimizer step ``step`` (counted from 0),
        or ``None`` for no averaging. Only called once warm-up is over."""

    def average(
        self, params: list[torch.Tensor], group: dist.ProcessGroup | ReplicaGroup
    ) -> None:
        """Average ``params`` over ``group`` in place; the one collective an averager
        runs. Override it to change what averaging means (e.g. an outer optimizer)."""
        average_in_place(params, group)

    def before_step(self, params: Iterable[torch.Tensor] | Iterable[Mapping[str, Any]]) -> None:
        """Called by :class:`~overlapkit.PostLocalSGDOptimizer` before each local step,
        with the same ``params`` as :meth:`average_parameters`. Nothing here; an
        averager that needs the parameters as a round starts (DiLoCo's outer step,
        whose first round starts before the first step) overrides it. Not a
        collective."""
        return None  # deliberately empty: most averagers only act after the step

    def before_step_at(self, step: int) -> bool:
        """Whether :meth:`before_step` uses the parameters before step ``step`` (an
        overlapped local optimizer takes those steps at ``step()``); override it with
        :meth:`before_step` (else every step is: :func:`declares_before_step`)."""
        return False

    def average_parameters(
        self, params: Iterable[torch.Tensor] | Iterable[Mapping[str, Any]]
    ) -> bool:
        """Count one optimizer step, and average every parameter in ``params`` if this
        step is an averaging step after warm-up.

        Call it after ``optimizer.step()`` on every rank of the process group (it is a
        collective on averaging steps), with the same parameters in the same order on
        every rank. As torch's averagers, only parameters with a gradient are averaged
        (see :func:`parameters_to_average`).

        :param params: ``model.parameters()`` or an optimizer's ``param_groups``.
        :return: whether parameters were averaged at this step.
        """
        averaged = False
        if self.step >= self.warmup_steps:
            group = self.group_for_step(self.step)
            if group is not None:
                self.average(parameters_to_average(params, group), group)
                averaged = True
        self.step += 1
        return averaged

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: ``{"step": ...}`` here; subclasses add
        their own entries (tensors included) to ``super().state_dict()``."""
        return {"step": self.step}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        :raises CheckpointError: the ``step`` entry is missing or not an integer.
        """
        step = state_dict.get("step")
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            step = int(step.item())
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(
                f"the averager state has no valid 'step' entry (got {step!r}); pass the "
                "'averager' entry of a PostLocalSGDOptimizer state_dict."
            )
        self.step = step

    def __repr__(self) -> str:
        return f"{type(self).__name__}(step={self.step}, warmup_steps={self.warmup_steps})"


class PeriodicAverager(ModelAverager):
    """Average over the whole process group every ``period`` steps after warm-up.

    The first averaging happens at step ``warmup_steps`` (the first local step), then
    every ``period`` steps: torch's ``PeriodicModelAverager`` schedule.

    :param period: optimizer steps between two averagings (>= 1).
    :param warmup_steps: steps before the first averaging.
    :param process_group: the group to average over (``None``: the default group).
    """

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | ReplicaGroup | None = None,
    ) -> None:
        self.period = check_period(period)
        super().__init__(warmup_steps=warmup_steps, process_group=process_group)
        if period == 1:
            warnings.warn(
                "PeriodicAverager(period=1) all-reduces the parameters every step, which "
                "costs at least as much as DDP's gradient allreduce; use plain DDP, or a "
                "period > 1.", UserWarning, stacklevel=2,
            )

    def group_for_step(self, step: int) -> dist.ProcessGroup | ReplicaGroup | None:
        """The process group every ``period`` steps from ``warmup_steps`` on."""
        if (step - self.warmup_steps) % self.period == 0:
            return self.process_group
        return None

    def __repr__(self) -> str:
        return (f"PeriodicAverager(period={self.period}, warmup_steps={self.warmup_steps}, "
                f"step={self.step})")


def validate_period_group_sizes(
    period_group_size_dict: object, overall_size: int | None
) -> dict[int, int]:
    """Check a hierarchical averaging plan; return it as a plain ``{period: size}``.

    The rules are torch's ``HierarchicalModelAverager``'s, checked up front: a
    non-empty mapping whose keys are strictly increasing periods >= 1 and whose values
    are group sizes dividing ``overall_size``, the last one equal to it. With
    ``overall_size=None`` only what does not depend on the group size is checked.

    :raises ConfigurationError: saying which rule is broken and what to pass.
    """
    top = "N" if overall_size is None else str(overall_size)
    example = f"e.g. {{4: 2, 16: {top}}} averages pairs every 4 steps and all every 16"
    if not isinstance(period_group_size_dict, Mapping) or not period_group_size_dict:
        raise ConfigurationError(
            f"period_group_size_dict must be a non-empty dict of period -> group size, got "
            f"{period_group_size_dict!r}; {example}."
        )
    plan: dict[int, int] = {}
    previous = 0
    for period, size in period_group_size_dict.items():
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ConfigurationError(
                f"period_group_size_dict keys are periods (integers >= 1), got {period!r}; "
                f"{example}."
            )
        if period <= previous:
            raise ConfigurationError(
                f"period_group_size_dict keys must be strictly increasing periods, got "
                f"{list(period_group_size_dict)}; list the levels from the most frequent "
                f"(smallest group) to the global one, {example}."
            )
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigurationError(
                f"period_group_size_dict[{period}] = {size!r} is not a group size; use a "
                f"positive integer dividing the number of ranks, {example}."
            )
        if overall_size is not None and overall_size % size != 0:
            raise ConfigurationError(
                f"period_group_size_dict[{period}] = {size} does not divide the process "
                f"group's {overall_size} ranks; use a divisor of {overall_size}."
            )
        plan[period] = size
        previous = period
    last_size = plan[previous]
    if overall_size is not None and last_size != overall_size:
        raise ConfigurationError(
            f"the last (largest-period) group size in period_group_size_dict must be the "
            f"whole process group, {overall_size} ranks, got {last_size}; add a top level "
            f"such as {{{previous}: {overall_size}}} or change the last size."
        )
    return plan


class HierarchicalAverager(ModelAverager):
    """Average over groups of several sizes, each at its own period, after warm-up.

    ``period_group_size_dict`` maps a period to a group size, e.g. ``{4: 2, 16: 8}``:
    groups of 2 consecutive ranks average every 4 steps, all 8 ranks every 16 steps.
    At a step divisible by several periods only the largest one averages (its group
    contains the smaller ones). Steps are counted from 0, as in torch's
    ``HierarchicalModelAverager``: the period test is ``step % period``, not counted
    from the end of warm-up. Groups of one rank never communicate.

    Every level's groups must lie within one node or be made of whole nodes
    (:mod:`overlapkit.nodes`: torchrun's agents, else host names): a plan written for
    one shape of job is refused at a launch it does not fit, before training.
    :func:`overlapkit.create_averager` ``("hierarchical", period=N)`` without a plan
    takes the levels from the launch (:mod:`overlapkit.local_sgd.hierarchy`).

    Creating it creates the subgroups, a collective: every rank of the process group
    must create it, with the same arguments.

    :param period_group_size_dict: period -> group size; see
        :func:`validate_period_group_sizes` for the rules.
    :param warmup_steps: steps before the first averaging.
    :param process_group: the top-level group (``None``: the default group); the last
        group size must be its size.
    """

    def __init__(
        self,
        period_group_size_dict: Mapping[int, int],
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(warmup_steps=warmup_steps, process_group=process_group)
        validate_period_group_sizes(period_group_size_dict, None)
        _require_initialized("HierarchicalAverager")
        top = self.process_group
        if isinstance(top, ReplicaGroup):
            raise ConfigurationError(
                "HierarchicalAverager needs a torch.distributed process group, got "
                f"{type(top).__name__}; average torchft replica groups with the "
                "'periodic' or 'diloco' averager."
            )
        overall = dist.get_world_size(top)
        self.period_group_size_dict = validate_period_group_sizes(period_group_size_dict, overall)
        # every level's groups within a node or of whole nodes (a collective, as the
        # subgroups below are: every rank raises alike)
        check_plan_follows_nodes(self.period_group_size_dict, node_layout(top))
        self._periods_largest_first = sorted(self.period_group_size_dict, reverse=True)
        #: period -> the group averaging at that period (``None``: one-rank groups)
        self.period_process_group_dict: dict[int, dist.ProcessGroup | None] = {}
        for period, size in self.period_group_size_dict.items():
            if size == overall:
                self.period_process_group_dict[period] = top
            elif size == 1:
                self.period_process_group_dict[period] = None
            else:
                self.period_process_group_dict[period], _ = dist.new_subgroups(
                    group_size=size, group=top
                )

    @property
    def period(self) -> int:
        """The largest period: how often the whole process group is averaged."""
        return self._periods_largest_first[0]

    def group_for_step(self, step: int) -> dist.ProcessGroup | None:
        """The group of the largest period dividing ``step``, if any."""
        for period in self._periods_largest_first:
            if step % period == 0:
                return self.period_process_group_dict[period]
        return None

    def __repr__(self) -> str:
        return (f"HierarchicalAverager({self.period_group_size_dict}, "
                f"warmup_steps={self.warmup_steps}, step={self.step})")
