"""What each rank runs for test_streaming.py: Streaming DiLoCo through
overlapkit.post_local_sgd, and the paper's schedule written by hand (no torchft)."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from diloco_ranks import _batch, _ddp, _flat

import overlapkit

#: two fragments (the MLP's two Linear layers), an outer step every 3 steps in turn
PERIOD, FRAGMENTS, STEPS = 6, 2, 14


def _train(rank: int, steps: range, delay: int, alpha: float,
           state: dict[str, Any] | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Train ``steps``; return the parameters and a checkpoint (model and optimizer)."""
    model = _ddp()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    opt = overlapkit.post_local_sgd(model, inner, period=PERIOD, warmup_steps=0,
                                    averager="diloco", subgroup_size=1, fragments=FRAGMENTS,
                                    fragment_sync_delay=delay, fragment_update_alpha=alpha)
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


def _paper(rank: int, world_size: int, delay: int, alpha: float) -> torch.Tensor:
    """Streaming DiLoCo as the paper schedules it (arXiv 2501.18512), by hand. Every
    H = PERIOD / FRAGMENTS inner steps one fragment p, in turn, is synchronised: tau =
    ``delay`` steps before, its outer gradient Delta_p = mean over workers of
    (theta_global_p - theta_p) is sent; when it has arrived, theta_global_p =
    OuterOpt(theta_global_p, Delta_p) (Nesterov SGD 0.7, 0.9, one per fragment) and
    theta_p = alpha * theta_p + (1 - alpha) * theta_global_p, computed as torch.lerp."""
    model = _ddp().module
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    fragments = [list(model[0].parameters()), list(model[2].parameters())]
    global_ = [[p.detach().clone() for p in f] for f in fragments]
    outers = [torch.optim.SGD(g, lr=0.7, momentum=0.9, nesterov=True) for g in global_]
    every = PERIOD // FRAGMENTS
    sent: dict[int, torch.Tensor] = {}
    for step in range(STEPS):
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad(set_to_none=True)
        t = step + 1
        with torch.no_grad():
            if (t + delay) % every == 0:  # fragment p's outer gradient leaves
                p = ((t + delay) // every - 1) % FRAGMENTS
                delta = torch.cat([(g - q).reshape(-1)
                                   for g, q in zip(global_[p], fragments[p], strict=True)])
                everyone = [torch.zeros_like(delta) for _ in range(world_size)]
                dist.all_gather(everyone, delta)
                sent[p] = torch.stack(everyone).sum(0) / world_size
            if t % every == 0:  # tau steps later it has arrived
                p = (t // every - 1) % FRAGMENTS
                mean, offset = sent.pop(p), 0
                for g in global_[p]:
                    g.grad = mean[offset:offset + g.numel()].view_as(g).clone()
                    offset += g.numel()
                outers[p].step()
                for g, q in zip(global_[p], fragments[p], strict=True):
                    q.copy_(torch.lerp(g, q, alpha))
                    g.grad = None
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def run_all(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for delay, alpha in ((0, 0.0), (2, 0.0), (2, 0.5)):
        name = f"delay{delay}-alpha{alpha}"
        results[name], _ = _train(rank, range(STEPS), delay, alpha)
        results[f"paper-{name}"] = _paper(rank, world_size, delay, alpha)
    # saved after step 7 (counted from 1): fragment 0's allreduce is in flight
    _, state = _train(rank, range(7), 2, 0.5)
    results["resumed"], _ = _train(rank, range(7, STEPS), 2, 0.5, state=state)
    results["saved_averager"] = state["optimizer"]["averager"]
    return results
