"""DiLoCo's outer step as an overlapkit model averager.

DiLoCo (Douillard et al., 2023, arXiv 2311.08105) lets every worker take ``period``
local (inner) optimizer steps, then treats the averaged change of the parameters over
that round as a gradient for an *outer* optimizer, Nesterov SGD by default::

    delta  = round_start - mean_over_ranks(params)     # the pseudo-gradient
    params = round_start - outer_optimizer_step(delta)  # then the next round starts

It communicates what periodic averaging communicates (one allreduce of the parameters
per round) and converges better at long periods.

The outer optimizer is a real ``torch.optim`` optimizer, stepped on *displacement*
tensors: each holds ``delta`` as its value and as its gradient, so after the outer
step it holds ``delta - update`` and the new parameters are
``mean(params) + (delta - update)``, which is ``round_start - update`` exactly as
written above. Written this way, outer lr 1 without momentum gives ``update == delta``,
a displacement of exactly zero, and parameters bitwise equal to periodic averaging.
It also means the outer optimizer must not use weight decay (it would decay the
displacement, not the parameters); that is refused.
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
    average_in_place,
)

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

    Same schedule as :class:`~overlapkit.local_sgd.averagers.PeriodicAverager` (first averaging at
    step ``warmup_steps``, then every ``period`` steps). A round starts at the end of
    warm-up; a run without warm-up starts its first round at its first averaging,
    which is then a plain average.

    :param period: local steps between two outer steps (DiLoCo's H).
    :param warmup_steps: steps of plain DDP before the first round.
    :param process_group: the group the rounds span (``None``: the default group).
    :param outer_lr: the outer Nesterov SGD's learning rate.
    :param outer_momentum: its momentum (0: plain SGD).
    :param outer_optimizer: instead of the two above, a function building any outer
        optimizer over a list of tensors (no weight decay).
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
    ) -> None:
        self.build_outer = outer_optimizer or nesterov_sgd(outer_lr, outer_momentum)
        super().__init__(period, warmup_steps, process_group)
        self.round_start: list[torch.Tensor] | None = None
        self._displacements: list[torch.Tensor] = []
        self.outer: torch.optim.Optimizer | None = None

    def average_parameters(self, params: Any) -> bool:
        """Count a step and average on schedule; at the last warm-up step, remember the
        parameters as the first round's start."""
        averaged = super().average_parameters(params)
        if self.step == self.warmup_steps and self.warmup_steps > 0:
            from overlapkit.plugin import parameters_to_average

            self._start_round(parameters_to_average(params))
        return averaged

    def average(self, params: list[torch.Tensor], group: dist.ProcessGroup) -> None:
        """Average the parameters, then take the outer step from the round's start."""
        average_in_place(params, group)
        if self.round_start is None:
            self._start_round(params)
            return
        self._check_layout(params)
        self._follow_devices(params)
        assert self.outer is not None
        with torch.no_grad():
            for param, start, displacement in zip(
                params, self.round_start, self._displacements, strict=True
            ):
                displacement.copy_(start).sub_(param)
                displacement.grad = displacement.detach().clone()
            self.outer.step()
            for param, displacement in zip(params, self._displacements, strict=True):
                param.add_(displacement)
                displacement.grad = None
        self._start_round(params)

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
        self._displacements = [torch.zeros_like(t) for t in like]
        self.outer = self.build_outer(self._displacements)
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
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the step, the round start and the outer optimizer's state."""
        super().load_state_dict(state_dict)
        if "round_start" not in state_dict:
            self.round_start, self.outer, self._displacements = None, None, []
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
                f"step={self.step}, outer={type(self.outer).__name__ if self.outer else None})")
