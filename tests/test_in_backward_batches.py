"""On CPU, ``optimizer_in_backward`` on a plain module steps the parameters whose
gradients are complete in batches of :data:`~overlapkit.overlap.in_backward.param_stepper.
BATCH_BYTES` of gradient, one engine call each, instead of one call per parameter
(``overlapkit.overlap.in_backward.param_stepper``): bitwise the plain loop, with at most
a batch of gradients alive at a time."""

from __future__ import annotations

import torch
from helpers import compare
from torch import nn

import overlapkit
from overlapkit.overlap.in_backward.param_stepper import BATCH_BYTES

LAYER_BYTES = 256 * 256 * 4  # one Linear(256, 256) weight: 256 KiB
LAYERS = 40  # 10.3 MB of gradient in all: three batches


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(256, 256) for _ in range(LAYERS)))


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 256, generator=generator) for _ in range(count)]


def test_batched_steps_are_the_plain_loops_bitwise() -> None:
    ours_model, plain_model = _model(), _model()
    ours = overlapkit.optimizer_in_backward(ours_model, torch.optim.AdamW, lr=0.01)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.01)
    for x in _batches(3):
        ours_model(x).square().mean().backward()
        assert all(p.grad is None for p in ours_model.parameters())
        plain_model(x).square().mean().backward()
        plain.step()
        plain.zero_grad()
    assert compare(list(plain_model.parameters()), list(ours_model.parameters()))
    assert compare(list(plain.state_dict()["state"][0].values()),
                   list(ours.optimizer.state_dict()["state"][0].values()))


def test_one_engine_call_per_batch_and_at_most_a_batch_of_gradients_alive() -> None:
    model = _model()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    partial_steps: list[int] = []
    opt.register_step_post_hook(lambda *_: partial_steps.append(1))
    params = list(model.parameters())
    alive: list[int] = []

    def count_alive(_: torch.Tensor) -> None:  # runs after overlapkit's hook
        alive.append(sum(p.grad.numel() * 4 for p in params if p.grad is not None))

    for param in params:
        param.register_post_accumulate_grad_hook(count_alive)
    model(_batches(1)[0]).square().mean().backward()
    # 16 layers (4.0 MiB and their biases) per batch: 16 + 16 + 8
    assert len(partial_steps) == 3, partial_steps
    assert max(alive) < BATCH_BYTES + LAYER_BYTES
    assert max(alive) > 8 * LAYER_BYTES  # gradients wait for their batch
    assert all(p.grad is None for p in params)
