"""The 0.3 loop work on a GPU (marked ``cuda``, skipped without one): on CUDA, autograd
runs the backward of CUDA tensors on a device thread, where the Python stack of a hook
holds no frame of the caller's ``backward()`` — the case
:mod:`overlapkit.overlap.core.backward_scope` reasons about for nested (reentrant
checkpointing) backwards. Steps run on side streams. Each case is bitwise the plain loop:
reentrant checkpointing (the first gradients inside or outside a nested backward),
backward-only loops, and a full step after only accumulating backwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import compare, values
from reentrant_checkpoint_ranks import Net
from torch import nn

import overlapkit
from overlapkit.distributed import run_distributed

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 4


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(3)
    return [torch.randn(16, 16, device="cuda", generator=generator) for _ in range(STEPS)]


def _net(head_inside: bool) -> nn.Module:
    torch.manual_seed(0)
    return Net(head_inside).cuda()


def _plain(model: nn.Module, clip: float | None = None) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for x in _batches():
        model(x).square().mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return values(model)


@pytest.mark.parametrize("head_inside", [False, True])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_cuda_reentrant_checkpointing_on_a_module(head_inside: bool,
                                                  clip: float | None) -> None:
    expected = _plain(_net(head_inside), clip)
    model = _net(head_inside)
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01,
                                           clip_grad_norm=clip)
    for x in _batches():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    assert compare(expected, values(model))


def test_cuda_backward_only_loop_on_a_module() -> None:
    expected = _plain(_net(False))
    model = _net(False)
    overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01)
    for x in _batches():
        model(x).square().mean().backward()  # no step(), no zero_grad()
    torch.cuda.synchronize()
    assert compare(expected, values(model))


def test_cuda_full_step_after_no_step_backwards_clips() -> None:
    def train(make: Callable[[nn.Module], Any], plain: bool) -> list[torch.Tensor]:
        model = _net(False)
        opt = make(model)
        batches = _batches()
        for first, second in zip(batches[::2], batches[1::2], strict=True):
            context = opt.no_step() if not plain else _Nothing()
            with context:
                model(first).square().mean().backward()
                model(second).square().mean().backward()
            if plain:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return values(model)

    expected = train(lambda m: torch.optim.AdamW(m.parameters(), lr=0.01), plain=True)
    got = train(lambda m: overlapkit.optimizer_in_backward(
        m, torch.optim.AdamW, lr=0.01, clip_grad_norm=0.05), plain=False)
    assert compare(expected, got)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _ddp_rank(rank: int, world_size: int) -> dict[str, Any]:
    """One rank (gloo over CUDA tensors): each technique with reentrant checkpointing,
    in the backward-only loop and in the step() loop, against plain DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, Any] = {}
    for head_inside in (False, True):
        reference = DDP(_net(head_inside), bucket_cap_mb=0.001)
        expected = _plain(reference)
        for technique in ("overlap_ddp", "optimizer_in_backward"):
            for loop in ("backward only", "step"):
                model = DDP(_net(head_inside), bucket_cap_mb=0.001)
                opt = getattr(overlapkit, technique)(model, torch.optim.AdamW, lr=0.01)
                for x in _batches():
                    model(x).square().mean().backward()
                    if loop == "step":
                        opt.step()
                        opt.zero_grad()
                torch.cuda.synchronize()
                out[f"{technique} {loop} head_inside={head_inside}"] = compare(
                    expected, values(model.module))
    return out


def test_cuda_ddp_reentrant_checkpointing_and_backward_only() -> None:
    (results,) = run_distributed(_ddp_rank, 1, timeout=300)
    failed = {case: result for case, result in results.items() if not result}
    assert not failed, failed
