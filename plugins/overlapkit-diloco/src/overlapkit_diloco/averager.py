"""DiLoCo's outer step as an overlapkit model averager.

DiLoCo (Douillard et al., 2023, arXiv 2311.08105) lets every worker take ``period``
local (inner) optimizer steps, then treats the averaged change of the parameters over
that round as a gradient for an *outer* optimizer, Nesterov SGD by default::

    delta  = mean_over_ranks(round_start - params)     # the pseudo-gradient
    params = round_start - outer_optimizer_step(delta)  # then the next round starts

Every rank computes its pseudo-gradient ``round_start - params``; one allreduce
averages them (the paper's Delta, with periodic averaging's arithmetic: one flat buffer
divided by the group size, then summed); the outer optimizer, a real ``torch.optim``
optimizer over copies of the round start, steps with Delta as their gradient, and the
parameters become its result. That is Algorithm 1 term for term, and torchft's
``DiLoCo`` arithmetic. It communicates what periodic averaging communicates (one
allreduce of the size of the parameters per round) and converges better at long periods.

Outer lr 1 without momentum gives ``round_start - mean(round_start - params)``: the
mean of the parameters up to rounding (1e-7 in float32), no longer bitwise periodic
averaging as before 0.4 (which averaged the parameters, not the deltas). The outer
optimizer must not use weight decay (not in the paper; decay the parameters in the
inner optimizer); that is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.plugin import (
    CheckpointError,
    ConfigurationError,
    PeriodicAverager,
    parameters_to_average,
)
from overlapkit_diloco.streaming import InFlightAverage, check_sync_delay, check_update_alpha

__all__ = ["DiLoCoAverager", "nesterov_sgd"]

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def nesterov_sgd(lr: float = 0.7, momentum: float = 0.9) -> OuterOptimizerFactory:
    """DiLoCo's default outer optimizer: SGD with Nesterov momentum (lr 0.7, momentum 0.9).

    ``momentum=0`` gives plain SGD (Nesterov needs a momentum).
    """
    if not lr > 0:
        raise ConfigurationError(f"outer_lr must be > 0, got {lr}; DiLoCo's default is 0.7.")
    if not 0 <= momentum < 1:
        raise ConfigurationError(
            f"outer_momentum must be in [0, 1), got {momentum}; DiLoCo's default is 0.9."
        )

    def build(displacements: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(displacements, lr=lr, momentum=momentum,
                               nesterov=momentum > 0)

    return build


class DiLoCoAverager(PeriodicAverager):
    """Periodic averaging whose averaging step is an outer optimizer step (DiLoCo).

    The schedule is the paper's (Algorithm 1) from the first round: a round starts
    when warm-up ends (at the first step when there is none), every worker takes
    ``period`` inner steps, then the outer step runs: after steps ``warmup_steps +
    period``, ``warmup_steps + 2 * period``, ... (counted from 1). Before 0.4 the first
    outer step came after one inner step (with warm-up) or a plain average after the
    first step started the first round (without): the paper's first round only came
    one round late.

    The round's start is taken by :meth:`before_step`, which
    :class:`~overlapkit.PostLocalSGDOptimizer` calls before each local step; an
    averager driven by hand with ``warmup_steps > 0`` also takes it at the last
    warm-up step's :meth:`average_parameters`. Driven by hand without warm-up, call
    :meth:`before_step` before the first inner step.

    :param period: inner steps per round (DiLoCo's H).
    :param warmup_steps: steps of plain DDP before the first round.
    :param process_group: the group the rounds span (``None``: the default group).
    :param outer_lr: the outer Nesterov SGD's learning rate.
    :param outer_momentum: its momentum (0: plain SGD).
    :param outer_optimizer: instead of the two above, a function building any outer
        optimizer over a list of tensors (no weight decay).
    :param fragments: Streaming DiLoCo's fragments (arXiv 2501.18512): the parameters
        are cut into this many contiguous runs of tensors (in order, the first runs one
        tensor longer when they do not divide evenly), and every ``period //
        fragments`` steps one fragment, in turn, takes its outer step over its own
        round: torchft's ``DiLoCo(model_fragments=..., fragment_sync_delay=0)``
        schedule. Each synchronisation sends ``1 / fragments`` of the parameters.
    :param fragment_sync_delay: Streaming DiLoCo's overlap (the paper's tau, torchft's
        ``fragment_sync_delay``): the fragment's pseudo-gradient is taken and its
        asynchronous allreduce started this many steps before its outer step, and the
        inner steps run while it is in flight. The outer step then starts from the
        fragment's round start as usual. In ``[0, period // fragments)``.
    :param fragment_update_alpha: after the outer step the fragment's parameters
        become ``lerp(outer result, local parameters, alpha)`` (torchft's mixing;
        the paper's ``alpha * local + (1 - alpha) * global``); 0 keeps the outer
        step's result, dropping the inner steps taken while the sync was in flight.
    """

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_optimizer: OuterOptimizerFactory | None = None,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        self.build_outer = outer_optimizer or nesterov_sgd(outer_lr, outer_momentum)
        super().__init__(period, warmup_steps, process_group)
        if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1 \
                or period % fragments:
            raise ConfigurationError(
                f"fragments must be an integer >= 1 dividing period {period}, got "
                f"{fragments!r}; pass e.g. fragments=2 with period=4 (one fragment "
                "synchronised every 2 steps)."
            )
        self.fragments = fragments
        self.fragment_sync_delay = check_sync_delay(fragment_sync_delay, self.sync_every)
        self.fragment_update_alpha = check_update_alpha(fragment_update_alpha)
        #: the synchronisation started and not yet applied (with a delay)
        self.in_flight: InFlightAverage | None = None
        self.round_start: list[torch.Tensor] | None = None
        self._outer_params: list[torch.Tensor] = []
        self.outer: torch.optim.Optimizer | None = None

    @property
    def sync_every(self) -> int:
        """Steps between two outer steps (of one fragment each with ``fragments``)."""
        return self.period // self.fragments

    def group_for_step(self, step: int) -> Any:
        """The process group after the ``period``-th inner step of each round (with
        fragments, after every ``period // fragments``-th), and with a sync delay
        also ``fragment_sync_delay`` steps earlier, when the sync starts."""
        if self.sync_starts_at(step) or self.sync_ends_at(step):
            return self.process_group
        return None

    def sync_starts_at(self, step: int) -> bool:
        """Whether a fragment's pseudo-gradient allreduce starts after step ``step``."""
        inner = step - self.warmup_steps + 1
        return inner >= 1 and (inner + self.fragment_sync_delay) % self.sync_every == 0

    def sync_ends_at(self, step: int) -> bool:
        """Whether a fragment's outer step runs after step ``step`` (the sync that
        started ``fragment_sync_delay`` steps earlier, or at this step, ends)."""
        inner = step - self.warmup_steps + 1
        return inner >= 1 and inner % self.sync_every == 0

    def fragment_at(self, step: int) -> int:
        """Which fragment's sync starts or ends after step ``step`` (0 without
        fragments): in turn, from the first."""
        inner = step - self.warmup_steps + 1 + self.fragment_sync_delay
        return (inner // self.sync_every - 1) % self.fragments

    def _fragment(self, count: int) -> range:
        """The indices of the current fragment's tensors among ``count``."""
        index = self.fragment_at(self.step)
        size, extra = divmod(count, self.fragments)
        start = index * size + min(index, extra)
        return range(start, start + size + (index < extra))

    def before_step(self, params: Any) -> None:
        """Before the first inner step (the step ``warmup_steps``), remember the
        parameters as the first round's start, unless :meth:`average_parameters` took
        it at the end of warm-up already: the same parameters in a plain loop, but
        under an overlapped inner optimizer this step was taken during backward, so a
        second read here would start the round one step late (0.4.0: 0.011 off after
        12 steps, warmup 2, with only a ``ParameterReadInWindowWarning``)."""
        if self.before_step_at(self.step):
            self._start_round(parameters_to_average(params))

    def before_step_at(self, step: int) -> bool:
        """Whether :meth:`before_step` reads the parameters before step ``step``: an
        overlapped inner optimizer takes that step at ``step()``, the others during
        backward."""
        return step == self.warmup_steps and (self.warmup_steps == 0
                                              or self.round_start is None)

    def average_parameters(self, params: Any) -> bool:
        """Count a step and take the outer step on schedule; at the last warm-up step,
        remember the parameters as the first round's start."""
        averaged = super().average_parameters(params)
        if self.step == self.warmup_steps and self.warmup_steps > 0:
            self._start_round(parameters_to_average(params))
        return averaged

    def average(self, params: list[torch.Tensor], group: Any) -> None:
        """Average the pseudo-gradients, then take the outer step from the round's
        start (with fragments: of the current fragment only)."""
        if self.round_start is None:
            raise ConfigurationError(
                "the DiLoCo averager has no round start: without warm-up, call "
                "averager.before_step(params) before the first inner step (as "
                "overlapkit.post_local_sgd's optimizer does), or use warmup_steps >= 1."
            )
        self._check_layout(params)
        self._follow_devices(params)
        if self.sync_starts_at(self.step):
            if self.in_flight is not None:
                raise ConfigurationError(
                    f"step {self.step} starts a DiLoCo sync while the previous one (fragment "
                    f"{self.in_flight.fragment}) was never applied: the averager's steps "
                    "were skipped. Call average_parameters after every optimizer step."
                )
            chosen = self._fragment(len(params))
            with torch.no_grad():  # Algorithm 1's delta: the round's start minus now
                pseudo = [self.round_start[i] - params[i] for i in chosen]
            self.in_flight = InFlightAverage(self.fragment_at(self.step), pseudo, group)
        if self.sync_ends_at(self.step):
            self._outer_step(params)

    def _outer_step(self, params: list[torch.Tensor]) -> None:
        """Wait for the fragment's averaged pseudo-gradient, take the outer step from
        the round's start, and mix in the local parameters (``fragment_update_alpha``)."""
        assert self.round_start is not None and self.outer is not None
        fragment = self.fragment_at(self.step)
        if self.in_flight is None or self.in_flight.fragment != fragment:
            raise ConfigurationError(
                f"step {self.step} ends fragment {fragment}'s DiLoCo sync, which never "
                "started: the averager's state was loaded from another step, or steps were "
                "skipped. Load the state saved with this averager's whole state_dict."
            )
        pseudo = self.in_flight.wait()  # the mean of the workers' deltas
        self.in_flight = None
        chosen = self._fragment(len(params))
        starts = [self.round_start[i] for i in chosen]
        outer_params = [self._outer_params[i] for i in chosen]
        fragment_params = [params[i] for i in chosen]
        alpha = self.fragment_update_alpha
        with torch.no_grad():
            local = [p.clone() for p in fragment_params] if alpha else []
            for start, outer_param, delta in zip(starts, outer_params, pseudo, strict=True):
                outer_param.copy_(start)
                outer_param.grad = delta.to(outer_param.device)
            self.outer.step()  # tensors without a gradient (other fragments) are skipped
            for param, outer_param, start in zip(fragment_params, outer_params, starts,
                                                 strict=True):
                param.copy_(outer_param)
                start.copy_(outer_param)  # the fragment's next round starts here
                outer_param.grad = None
            for param, mine in zip(fragment_params, local, strict=False):
                param.lerp_(mine, alpha)  # torchft's merge of local and global

    def _follow_devices(self, params: list[torch.Tensor]) -> None:
        """Move the round start and displacements to the parameters' devices: a state
        loaded with ``map_location="cpu"`` into a GPU run lands on the CPU."""
        assert self.round_start is not None and self.outer is not None
        if all(s.device == p.device for s, p in zip(self.round_start, params, strict=True)):
            return
        self.round_start = [s.to(p.device) for s, p in zip(self.round_start, params,
                                                           strict=True)]
        state = self.outer.state_dict()
        self._make_outer([s for s in self.round_start])
        self.outer.load_state_dict(state)  # moves the momentum to the new tensors' devices

    def _start_round(self, params: list[torch.Tensor]) -> None:
        with torch.no_grad():
            if self.round_start is None:
                self.round_start = [p.detach().clone() for p in params]
                self._make_outer(self.round_start)
            else:
                for start, param in zip(self.round_start, params, strict=True):
                    start.copy_(param)

    def _make_outer(self, like: list[torch.Tensor]) -> None:
        self._outer_params = [torch.zeros_like(t) for t in like]
        self.outer = self.build_outer(self._outer_params)
        if any(group.get("weight_decay", 0) for group in self.outer.param_groups):
            raise ConfigurationError(
                "the DiLoCo outer optimizer must not use weight_decay (it would decay the "
                "pseudo-gradient, not the parameters); use weight decay in the inner "
                "optimizer instead."
            )

    def _check_layout(self, params: list[torch.Tensor]) -> None:
        assert self.round_start is not None
        shapes = [tuple(p.shape) for p in params]
        expected = [tuple(t.shape) for t in self.round_start]
        if shapes != expected:
            raise ConfigurationError(
                f"DiLoCo was given {len(shapes)} parameters shaped differently from the "
                f"{len(expected)} of the round start; pass the same parameters, in the same "
                "order, at every step."
            )

    def state_dict(self) -> dict[str, Any]:
        """The step, the round start and the outer optimizer's state (momentum)."""
        state = super().state_dict()
        if self.round_start is not None:
            assert self.outer is not None
            state["round_start"] = [t.clone() for t in self.round_start]
            state["outer_optimizer"] = self.outer.state_dict()
        if self.in_flight is not None:  # waits for the sync: its mean is part of the state
            state["in_flight"] = {"fragment": self.in_flight.fragment,
                                  "delta": [t.clone() for t in self.in_flight.wait()],
                                  "settings": self._sync_settings()}
        return state

    def _sync_settings(self) -> dict[str, int]:
        """What decides at which step a sync in flight is applied."""
        return {"period": self.period, "fragments": self.fragments,
                "fragment_sync_delay": self.fragment_sync_delay}

    def _check_in_flight(self, in_flight: Any) -> None:
        """Refuse, before anything loads, a sync in flight saved under other settings:
        at 968cf42 it loaded, and a later step raised "the averager's steps were
        skipped. Call average_parameters after every optimizer step", which was not
        the cause."""
        saved = in_flight.get("settings") if isinstance(in_flight, Mapping) else None
        if not isinstance(saved, Mapping) or dict(saved) == self._sync_settings():
            return
        raise CheckpointError(
            f"the DiLoCo averager state holds a sync in flight (fragment "
            f"{in_flight.get('fragment')}) saved with {dict(saved)}, but this averager has "
            f"{self._sync_settings()}: the step that applies it would never come. Resume "
            "with the saved period, fragments and fragment_sync_delay (change them at a "
            "checkpoint with no sync in flight). Nothing was loaded.")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the step, the round start, the outer optimizer's state and a sync
        in flight (its averaged pseudo-gradient)."""
        in_flight = state_dict.get("in_flight")
        if in_flight is not None:
            self._check_in_flight(in_flight)
        super().load_state_dict(state_dict)
        self.in_flight = None if in_flight is None else InFlightAverage(
            int(in_flight["fragment"]),
            [torch.as_tensor(t).detach().clone() for t in in_flight["delta"]], None)
        if "round_start" not in state_dict:
            self.round_start, self.outer, self._outer_params = None, None, []
            return
        if "outer_optimizer" not in state_dict:
            raise CheckpointError(
                "the DiLoCo averager state has 'round_start' but no 'outer_optimizer'; "
                "pass the whole 'averager' entry of the optimizer's state_dict."
            )
        self.round_start = [torch.as_tensor(t).detach().clone()
                            for t in state_dict["round_start"]]
        self._make_outer(self.round_start)
        assert self.outer is not None
        self.outer.load_state_dict(state_dict["outer_optimizer"])

    def __repr__(self) -> str:
        return (f"DiLoCoAverager(period={self.period}, warmup_steps={self.warmup_steps}, "
                f"fragments={self.fragments}, "
                f"fragment_sync_delay={self.fragment_sync_delay}, "
                f"fragment_update_alpha={self.fragment_update_alpha}, "
                f"step={self.step}, outer={type(self.outer).__name__ if self.outer else None})")
