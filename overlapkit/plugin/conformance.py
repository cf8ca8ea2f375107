"""Conformance checks a plugin author calls from one test: does the plugin do what its
record promises, against the plain PyTorch result, on real gloo ranks?

- :func:`check_overlapped_optimizer`: ``overlap_ddp(ddp, optim_cls, ...)`` — the
  plugin's bucket steps — equals ``optim_cls``'s own ``step()`` on plain DDP, bitwise,
  after every step of several, with an LR scheduler, and its ``state_dict()`` loads
  into the plain optimizer and back (training then goes on equal). A bucket step that
  does nothing, or something else, fails with the parameter and the difference.
- :func:`check_averager`: in its documented limit (options the author passes) the
  averager averages exactly (every rank holds the mean, bitwise torch's flat-buffer
  arithmetic), and its ``state_dict()`` round-trips into a fresh one.
- :func:`check_comm_hook`: a DDP run with the hook completes on every rank, the
  replicas stay equal, and the result is within ``tolerance`` of DDP's own allreduce.

Each raises :class:`ConformanceError` saying what differed; each spawns its own ranks
(2 by default) with :func:`overlapkit.distributed.run_distributed`, so the plugin must
be importable by name (installed, or on ``sys.path``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["ConformanceError", "check_averager", "check_comm_hook",
           "check_overlapped_optimizer"]

STEPS = 4


class ConformanceError(AssertionError):
    """A plugin does not do what its record promises; the message says what differed."""


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step))


def _differences(expected: list[torch.Tensor], actual: list[torch.Tensor],
                 names: list[str]) -> list[str]:
    out = []
    for name, a, b in zip(names, expected, actual, strict=True):
        if not torch.equal(a, b):
            out.append(f"{name} (max |diff| {float((a.double() - b.double()).abs().max()):.3g})")
    return out


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _raise(failures: list[str], what: str) -> None:
    if failures:
        raise ConformanceError(f"{what}:\n  " + "\n  ".join(failures))


# -- overlapped optimizers --------------------------------------------------------------


def _optimizer_rank(rank: int, world_size: int, optim_cls: type[torch.optim.Optimizer],
                    kwargs: dict[str, Any]) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import overlapkit

    names = [n for n, _ in _model().named_parameters()]
    plain_ddp = DDP(_model(), bucket_cap_mb=0.001)
    ours_ddp = DDP(_model(), bucket_cap_mb=0.001)
    plain = optim_cls(plain_ddp.parameters(), **kwargs)
    ours = overlapkit.overlap_ddp(ours_ddp, optim_cls, **kwargs)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
                  for o in (plain, ours)]
    start = _snapshot(plain_ddp.module)
    failures: list[str] = []
    for step in range(STEPS):
        for model, opt, sched in ((plain_ddp, plain, schedulers[0]),
                                  (ours_ddp, ours, schedulers[1])):
            model(_batch(rank, step)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        differ = _differences(_snapshot(plain_ddp.module), _snapshot(ours_ddp.module), names)
        if differ:
            failures.append(f"after step {step + 1}, rank {rank}: the bucket steps differ "
                            f"from {optim_cls.__qualname__}.step() in " + ", ".join(differ))
            break
    if not _differences(start, _snapshot(plain_ddp.module), names):
        failures.append(f"{optim_cls.__qualname__}.step() itself changed nothing with "
                        f"{kwargs}: pass options under which it trains")
    # state_dict round trip: ours -> a plain optimizer, plain -> ours; both go on equal
    # (deep copies: load_state_dict keeps the given tensors, which would then be shared)
    plain.load_state_dict(copy.deepcopy(ours.state_dict()))
    ours.load_state_dict(copy.deepcopy(plain.state_dict()))
    for model, opt in ((plain_ddp, plain), (ours_ddp, ours)):
        model(_batch(rank, STEPS)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    differ = _differences(_snapshot(plain_ddp.module), _snapshot(ours_ddp.module), names)
    if differ and not failures:
        failures.append(f"rank {rank}: after a state_dict round trip the next step differs "
                        "in " + ", ".join(differ))
    return failures


def check_overlapped_optimizer(optim_cls: type[torch.optim.Optimizer],
                               optim_kwargs: Mapping[str, Any] | None = None, *,
                               world_size: int = 2, timeout: float = 180.0) -> None:
    """Check that ``overlap_ddp`` with ``optim_cls`` (through whatever engine the
    installed plugins register for it) equals ``optim_cls``'s own ``step()`` on plain
    DDP, bitwise, over several steps with an LR scheduler and a ``state_dict`` round
    trip, on ``world_size`` gloo ranks with several buckets.

    :raises ConformanceError: naming the step, the parameter and the difference.
    """
    from overlapkit.distributed import run_distributed

    results = run_distributed(_optimizer_rank, world_size,
                              args=(optim_cls, dict(optim_kwargs or {})), timeout=timeout)
    _raise([f for rank in results for f in rank],
           f"the overlapped {optim_cls.__qualname__} does not equal its own step()")


# -- averagers --------------------------------------------------------------------------


def _averager_rank(rank: int, world_size: int, name: str, options: dict[str, Any]) -> list[str]:
    import torch.distributed as dist

    import overlapkit

    failures = []
    # As under DDP, the ranks hold the same parameters through warm-up, then each
    # rank's local steps move them apart (an averager with rounds, DiLoCo's, starts
    # its first round from the common parameters).
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    averager = overlapkit.create_averager(name, **options)
    for _ in range(int(getattr(averager, "warmup_steps", 0))):
        averager.average_parameters(model.parameters())
    before_step = getattr(averager, "before_step", None)
    if before_step is not None:
        before_step(model.parameters())
    expected = []
    with torch.no_grad():
        for index, p in enumerate(model.parameters()):
            gen = torch.Generator().manual_seed(1000 * rank + index)
            p.add_(torch.randn(p.shape, generator=gen), alpha=0.1)  # the local steps
            total = p.detach().clone()
            dist.all_reduce(total)
            expected.append(total / world_size)
    averaged = False
    for _ in range(int(getattr(averager, "period", 1))):
        averaged = averager.average_parameters(model.parameters()) or averaged
    if not averaged:
        failures.append(f"rank {rank}: {name} did not average within one period after "
                        f"warm-up with {options}")
    else:
        differ = [n for n, a, b in zip(names, expected, _snapshot(model), strict=True)
                  if not torch.allclose(a, b, rtol=1e-6, atol=1e-7)]
        if differ:
            failures.append(f"rank {rank}: after averaging with {options}, "
                            f"{', '.join(differ)} are not the mean over the ranks")
    state = averager.state_dict()
    fresh = overlapkit.create_averager(name, **options)
    fresh.load_state_dict(state)
    if fresh.state_dict().keys() != state.keys() or fresh.step != averager.step:
        failures.append(f"rank {rank}: {name}'s state_dict() did not round-trip "
                        f"({state!r} -> {fresh.state_dict()!r})")
    return failures


def check_averager(name: str, limit_options: Mapping[str, Any], *, world_size: int = 2,
                   timeout: float = 120.0) -> None:
    """Check that the averager registered as ``name``, built with ``limit_options``
    (those under which it must reduce to exact averaging, e.g. DiLoCo's
    ``outer_lr=1.0, outer_momentum=0.0``), makes every rank hold the mean of the
    ranks' parameters at its first averaging step, and that its ``state_dict()``
    loads into a fresh one.

    :raises ConformanceError: saying which parameters were not averaged, or what the
        state round trip lost.
    """
    from overlapkit.distributed import run_distributed

    results = run_distributed(_averager_rank, world_size, args=(name, dict(limit_options)),
                              timeout=timeout)
    _raise([f for rank in results for f in rank], f"the averager {name!r} does not conform")


# -- comm hooks -------------------------------------------------------------------------


def _comm_hook_rank(rank: int, world_size: int, name: str, options: dict[str, Any],
                    tolerance: float) -> list[str]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import overlapkit

    runs = []
    for hooked in (False, True):
        ddp = DDP(_model(), bucket_cap_mb=0.001)
        if hooked:
            state, hook = overlapkit.build_comm_hook(name, **options)
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(STEPS):
            ddp(_batch(rank, step)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))
    failures = []
    gathered = [torch.empty_like(runs[1]) for _ in range(world_size)]
    dist.all_gather(gathered, runs[1])
    if not all(torch.equal(gathered[0], g) for g in gathered):
        failures.append(f"rank {rank}: with {name!r} the replicas differ between ranks")
    difference = float((runs[0] - runs[1]).abs().max())
    if difference > tolerance:
        failures.append(f"rank {rank}: with {name!r} the parameters are {difference:.3g} "
                        f"from DDP's allreduce after {STEPS} steps (tolerance {tolerance})")
    return failures


def check_comm_hook(name: str, options: Mapping[str, Any] | None = None, *,
                    tolerance: float = 0.0, world_size: int = 2,
                    timeout: float = 120.0) -> None:
    """Check that a DDP run with the comm hook registered as ``name`` completes, keeps
    the replicas equal, and ends within ``tolerance`` (max absolute difference of the
    parameters) of DDP's own allreduce: 0 for an exact hook, the compression error
    for a compressing one.

    :raises ConformanceError: saying what differed.
    """
    from overlapkit.distributed import run_distributed

    results = run_distributed(_comm_hook_rank, world_size,
                              args=(name, dict(options or {}), tolerance), timeout=timeout)
    _raise([f for rank in results for f in rank], f"the comm hook {name!r} does not conform")


#: for :func:`check_overlapped_optimizer` callers that want the model it uses
MODEL: Callable[[int], nn.Module] = _model
