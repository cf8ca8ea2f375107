"""What each rank runs for test_diloco.py: every scenario in one spawned run."""

from __future__ import annotations

import io
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit_diloco import DiLoCoAverager

WARMUP, PERIOD, STEPS = 2, 3, 12


def _ddp() -> DDP:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    return DDP(model, bucket_cap_mb=0.0002)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)


def _train(rank: int, averager: str, steps: range, state: dict[str, Any] | None = None,
           warmup: int = WARMUP, **options: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Train ``steps``; return the parameters and a checkpoint (model and optimizer)."""
    model = _ddp()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    opt = overlapkit.post_local_sgd(model, inner, period=PERIOD, warmup_steps=warmup,
                                    averager=averager, subgroup_size=1, **options)
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    for step in steps:
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    buffer = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    return _flat(model), torch.load(buffer, weights_only=False)


def _algorithm_1(rank: int, world_size: int, warmup: int, steps: int) -> torch.Tensor:
    """DiLoCo as the paper writes it (arXiv 2311.08105, Algorithm 1), by hand: ``warmup``
    steps of plain DDP, then rounds of ``PERIOD`` inner steps on each worker alone,
    each followed by the outer step: Delta = mean over workers of (theta_start -
    theta_i), theta = OuterOpt(theta_start, Delta) with Nesterov SGD (0.7, 0.9)."""
    model = _ddp()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    params = list(model.parameters())
    start: list[torch.Tensor] = []
    outer: torch.optim.Optimizer | None = None
    for step in range(steps):
        x, y = _batch(rank, step)
        if step < warmup:
            torch.nn.functional.mse_loss(model(x), y).backward()  # DDP: gradients averaged
        else:
            if step == warmup:  # theta^(0): the model as the first round starts
                start = [p.detach().clone() for p in params]
                outer = torch.optim.SGD(start, lr=0.7, momentum=0.9, nesterov=True)
            torch.nn.functional.mse_loss(model.module(x), y).backward()  # one worker alone
        inner.step()
        inner.zero_grad(set_to_none=True)
        if step >= warmup and (step - warmup + 1) % PERIOD == 0:
            assert outer is not None
            with torch.no_grad():
                deltas = torch.cat([(s - p).reshape(-1)
                                    for s, p in zip(start, params, strict=True)])
                deltas.div_(world_size)
                dist.all_reduce(deltas)  # Delta: the workers' mean pseudo-gradient
                offset = 0
                for s in start:
                    s.grad = deltas[offset:offset + s.numel()].view_as(s).clone()
                    offset += s.numel()
                outer.step()  # start becomes theta^(t)
                for s, p in zip(start, params, strict=True):
                    p.copy_(s)
                    s.grad = None
    return _flat(model)


def _first_round_without_start(rank: int) -> str:
    """An averager driven by hand with no warm-up and no before_step: refused."""
    averager = DiLoCoAverager(2)
    params = [torch.ones(3, requires_grad=True)]
    averager.average_parameters(params)
    try:
        averager.average_parameters(params)
    except overlapkit.ConfigurationError as error:
        return str(error)
    return "no error"


def _nesterov_by_hand(rank: int, world_size: int) -> dict[str, Any]:
    """Three rounds of the averager on hand-set parameters, against the formula."""
    lr, momentum = 0.7, 0.9
    params = [torch.zeros(4), torch.zeros(2, 3)]
    averager = DiLoCoAverager(1, warmup_steps=1, outer_lr=lr, outer_momentum=momentum)
    averager.average_parameters(params)  # the last warm-up step: the round starts here
    start = [p.clone() for p in params]
    buffers = [torch.zeros_like(p) for p in params]
    worst = 0.0
    for round_ in range(3):
        moved = []
        for index, p in enumerate(params):
            gen = torch.Generator().manual_seed(10 * round_ + index)
            shared = torch.randn(p.shape, generator=gen)
            p.add_(shared * (rank + 1))  # each rank's local progress differs
            moved.append(p.clone())
        everyone = [torch.zeros(sum(m.numel() for m in moved)) for _ in range(world_size)]
        dist.all_gather(everyone, torch.cat([m.reshape(-1) for m in moved]))
        mean = torch.stack(everyone).double().mean(0)
        averager.average_parameters(params)
        offset = 0
        for index, p in enumerate(params):
            avg = mean[offset:offset + p.numel()].reshape(p.shape)
            offset += p.numel()
            delta = start[index].double() - avg
            buffers[index] = momentum * buffers[index].double() + delta
            expected = start[index].double() - lr * (delta + momentum * buffers[index])
            worst = max(worst, float((p.double() - expected).abs().max()))
            start[index] = expected.float()
    return {"nesterov_max_error": worst}


def _overlapped_inner_steps(rank: int, warmup: int = 0,
                            overlapped: bool = True) -> tuple[torch.Tensor, list[str]]:
    """No warm-up, the inner AdamW stepped during backward (``optimizer_in_backward``)
    under ``PostLocalSGDOptimizer``: the first round starts before the first inner step,
    which the overlapped optimizer then takes at ``step()`` (0.4.0: during backward,
    so the round started after it, 0.030 off the paper's run, silently). With warm-up
    the round starts at its end (9b5962c: again before the step ``warmup``, which had
    been taken during backward: 0.011 off the plain inner AdamW, only warned of)."""
    model = _ddp().module
    inner = (overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01) if overlapped
             else torch.optim.AdamW(model.parameters(), lr=0.01))
    opt = overlapkit.PostLocalSGDOptimizer(inner, DiLoCoAverager(PERIOD, warmup))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            x, y = _batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return _flat(model), [str(w.message) for w in caught]


def run_all(rank: int, world_size: int) -> dict[str, Any]:
    diloco, _ = _train(rank, "diloco", range(STEPS))
    no_warmup, _ = _train(rank, "diloco", range(STEPS), warmup=0)
    _, state = _train(rank, "diloco", range(7))
    resumed, _ = _train(rank, "diloco", range(7, STEPS), state=state)
    results = {
        "diloco": diloco, "no_warmup": no_warmup, "resumed": resumed,
        "paper": _algorithm_1(rank, world_size, WARMUP, STEPS),
        "paper_no_warmup": _algorithm_1(rank, world_size, 0, STEPS),
        "unstarted_error": _first_round_without_start(rank),
        "saved_averager": state["optimizer"]["averager"],
    }
    results.update(_nesterov_by_hand(rank, world_size))
    results["overlapped"], results["overlapped warnings"] = _overlapped_inner_steps(rank)
    results["overlapped warmup"], results["overlapped warmup warnings"] = (
        _overlapped_inner_steps(rank, WARMUP))
    results["plain warmup"], _ = _overlapped_inner_steps(rank, WARMUP, overlapped=False)
    return results
