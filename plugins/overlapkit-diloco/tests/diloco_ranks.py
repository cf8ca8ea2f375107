"""What each rank runs for test_diloco.py: every scenario in one spawned run."""

from __future__ import annotations

import io
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


def _train(rank: int, averager: str, steps: range, state: dict[str, Any] | None = None,
           **options: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Train ``steps``; return the parameters and a checkpoint (model and optimizer)."""
    model = _ddp()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    opt = overlapkit.post_local_sgd(model, inner, period=PERIOD, warmup_steps=WARMUP,
                                    averager=averager, subgroup_size=1, **options)
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    for step in steps:
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    buffer = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    return _flat(model), torch.load(buffer, weights_only=False)


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


def run_all(rank: int, world_size: int) -> dict[str, Any]:
    periodic, _ = _train(rank, "periodic", range(STEPS))
    unit, _ = _train(rank, "diloco", range(STEPS), outer_lr=1.0, outer_momentum=0.0)
    diloco, _ = _train(rank, "diloco", range(STEPS))
    _, state = _train(rank, "diloco", range(7))
    resumed, _ = _train(rank, "diloco", range(7, STEPS), state=state)
    results = {
        "periodic": periodic, "diloco_unit": unit, "diloco": diloco, "resumed": resumed,
        "saved_averager": state["optimizer"]["averager"],
    }
    results.update(_nesterov_by_hand(rank, world_size))
    return results
