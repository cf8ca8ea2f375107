"""A copy of a model a technique steps is a plain model: ``torch.save(model)`` and an
EMA's ``copy.deepcopy`` (``torch.optim.swa_utils.AveragedModel``) take the model's hooks
along (:mod:`overlapkit.overlap.core.own_hooks`)."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import overlapkit


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _train_with_ema(overlapped: bool) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                               torch.Tensor]:
    model = _model()
    opt: Any = (overlapkit.optimizer_in_backward(model, torch.optim.Adam, lr=0.05)
                if overlapped else torch.optim.Adam(model.parameters(), lr=0.05))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    batches = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(4, 8, generator=batches)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(model)
    probe = torch.randn(2, 8, generator=batches)
    ema(probe).square().mean().backward()  # the copy trains nothing of the model's
    with torch.no_grad():
        out = ema(probe)
    return ([p.detach().clone() for p in model.parameters()],
            [p.detach().clone() for p in ema.module.parameters()], out)


def test_an_ema_copy_of_a_module_stepped_in_backward_is_bitwise_the_plain_loops() -> None:
    plain, plain_ema, plain_out = _train_with_ema(overlapped=False)
    ours, our_ema, our_out = _train_with_ema(overlapped=True)
    for a, b in zip(plain + plain_ema, ours + our_ema, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(plain_out, our_out)


@pytest.mark.parametrize("copy_with", ["torch.save", "deepcopy"])
def test_a_saved_or_copied_module_runs_as_a_plain_module(copy_with: str) -> None:
    import copy

    model = _model()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    if copy_with == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    else:
        copied = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    copied(torch.ones(2, 8)).sum().backward()  # no guard refuses it, nothing steps
    assert all(p.grad is not None for p in copied.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    for a, b in zip(model.parameters(), copied.parameters(), strict=True):
        assert torch.equal(a, b)
    # the trained module keeps its guards and steps
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    assert not torch.equal(before[0], next(model.parameters()))


def _copy_a_ddp_model(rank: int, world_size: int) -> dict[str, Any]:
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        ddp = DDP(_model())
        opt = getattr(overlapkit, technique)(ddp, torch.optim.SGD, lr=0.1)
        ddp(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        for copy_with in ("torch.save", "deepcopy"):
            if copy_with == "torch.save":
                buffer = io.BytesIO()
                torch.save(ddp, buffer)
                buffer.seek(0)
                copied = torch.load(buffer, weights_only=False)
            else:
                copied = copy.deepcopy(ddp)
            before = [p.detach().clone() for p in copied.parameters()]
            copied(torch.ones(2, 8)).sum().backward()  # a plain DDP model: nothing steps
            out[f"{technique} {copy_with}"] = (
                not copied._comm_hooks
                and all(p.grad is not None for p in copied.parameters())
                and all(torch.equal(a, b) for a, b in zip(before, copied.parameters(),
                                                          strict=True)))
            # and it can be set up again, as the plain copy can
            again = getattr(overlapkit, technique)(copied, torch.optim.SGD, lr=0.1)
            copied.zero_grad()
            copied(torch.ones(2, 8)).sum().backward()
            again.step()
            out[f"{technique} {copy_with} set up again"] = not torch.equal(
                before[0], next(copied.parameters()))
            again.release()
        before = next(ddp.parameters()).detach().clone()  # the original still steps
        ddp(torch.ones(2, 8)).sum().backward()
        opt.step()
        out[f"{technique} original"] = not torch.equal(before, next(ddp.parameters()))
    return out


def test_a_saved_or_copied_ddp_model_is_a_plain_ddp_model() -> None:
    # 0.4.0 before: torch.save(ddp_model) raised pickle's "Can't pickle local object
    # WeakSet...", copy.deepcopy "cannot pickle '_thread.RLock' object"
    from overlapkit.distributed import run_distributed

    results = run_distributed(_copy_a_ddp_model, 1, timeout=120)[0]
    assert all(results.values()), results
