"""On CPU, ``optimizer_in_backward`` on a plain module steps the parameters whose
gradients are complete in batches of :data:`~overlapkit.overlap.in_backward.param_batch.
BATCH_BYTES` of gradient, one engine call each, instead of one call per parameter
(``overlapkit.overlap.in_backward.param_batch``): bitwise the plain loop, with at most
a batch of gradients alive at a time."""

from __future__ import annotations

import pytest
import torch
from helpers import FailsInBackward, compare, on_each_real_step
from torch import nn

import overlapkit
from overlapkit.overlap.in_backward.param_batch import BATCH_BYTES

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
    on_each_real_step(opt, lambda _: partial_steps.append(1))
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


# -- what a batch does where a backward is not one plain pass -------------------------

class _Shared(nn.Module):
    """One layer applied in three reentrant-checkpointed segments (ALBERT's sharing):
    its parameters are accumulated once per segment, each in a backward of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(64, 64)
        self.head = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for _ in range(3):
            x = checkpoint(lambda h: torch.tanh(self.shared(h)), x, use_reentrant=True)
        return self.head(x)


def _shared() -> _Shared:
    torch.manual_seed(0)
    return _Shared()


def test_a_parameter_shared_by_reentrant_segments_is_stepped_once_with_its_whole_gradient(
) -> None:
    ours_model, plain_model = _shared(), _shared()
    ours = overlapkit.optimizer_in_backward(ours_model, torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 64, generator=generator, requires_grad=True)
        ours_model(x).square().mean().backward()
        plain_model(x).square().mean().backward()
        plain.step()
        plain.zero_grad()
    assert [float(ours.optimizer.state[p]["step"]) for p in ours_model.parameters()] \
        == [3.0] * 4
    assert compare(list(plain_model.parameters()), list(ours_model.parameters()))


def test_a_parameter_accumulated_again_after_its_step_is_an_error() -> None:
    # used outside a reentrant segment (its hook runs first, and the 4 MiB weight fills
    # a batch) and inside it (accumulated again in the segment's own backward)
    from torch.utils.checkpoint import checkpoint

    from overlapkit.errors import ConfigurationError

    torch.manual_seed(0)
    layer = nn.Linear(1024, 1024)
    opt = overlapkit.optimizer_in_backward(layer, torch.optim.SGD, lr=0.1)
    x = torch.randn(2, 1024, requires_grad=True)
    inner = checkpoint(lambda h: torch.tanh(layer(h)), x, use_reentrant=True)
    with pytest.raises(ConfigurationError, match="use_reentrant=False"):
        layer(inner).square().mean().backward()
    assert opt is not None


def test_a_batch_spanning_two_groups_frees_only_what_stepped() -> None:
    # the second group's step raises: the first group stepped (gradients freed), the
    # second kept its gradients; backward raises the optimizer's error
    model = _model()
    first, second = list(model[:20].parameters()), list(model[20:].parameters())
    opt = overlapkit.optimizer_in_backward(
        model, torch.optim.SGD, params=[{"params": first}, {"params": second}], lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[1]["lr"] = "not a number"
    small = nn.Sequential(*list(model)[15:25])  # a batch across the groups' border
    with pytest.raises(TypeError):
        small(torch.randn(4, 256)).square().mean().backward()
    changed = [not torch.equal(a, p) for a, p in zip(before, model.parameters(),
                                                      strict=True)]
    assert changed[30:40] == [True] * 10 and changed[40:50] == [False] * 10
    assert all(p.grad is None for p in list(model.parameters())[30:40])
    assert all(p.grad is not None for p in list(model.parameters())[40:50])


def test_a_backward_that_raised_steps_nothing_of_its_batch_and_leaves_no_gradient() -> None:
    # the layers after the failing function had complete gradients, batched: not
    # stepped, and not carried into the next backward (a backward-only loop)
    ours_model, plain_model = _model(), _model()
    overlapkit.optimizer_in_backward(ours_model, torch.optim.SGD, lr=0.1)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    x, y = _batches(2)
    hidden = FailsInBackward.apply(ours_model[:36](x))  # 4 layers after it: one batch
    with pytest.raises(RuntimeError, match="simulated"):
        ours_model[36:](hidden).square().mean().backward()
    assert all(p.grad is not None for p in ours_model[36:].parameters())  # not stepped
    ours_model(y).square().mean().backward()
    plain_model(y).square().mean().backward()  # the plain loop dropped the failed one
    plain.step()
    assert compare(list(plain_model.parameters()), list(ours_model.parameters()))


def test_a_4_mib_layer_shared_by_reentrant_segments_waits_for_the_end_of_backward() -> None:
    # each part of its gradient fills a batch: stepping it there would take part of it
    from torch.utils.checkpoint import checkpoint

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.ModuleDict({"shared": nn.Linear(1024, 1024), "head": nn.Linear(1024, 8)})

    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = checkpoint(lambda h: torch.tanh(model["shared"](h)), x, use_reentrant=True)
        return model["head"](x)

    ours_model, plain_model = build(), build()
    overlapkit.optimizer_in_backward(ours_model, torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(2, 1024, generator=generator, requires_grad=True)
        forward(ours_model, x).square().mean().backward()
        forward(plain_model, x).square().mean().backward()
        plain.step()
        plain.zero_grad()
    assert compare(list(plain_model.parameters()), list(ours_model.parameters()))


def _raise_once(model: nn.Sequential, x: torch.Tensor) -> None:
    """A backward that raises after the last 4 layers' gradients are complete (one
    batch, not stepped)."""
    hidden = FailsInBackward.apply(model[:36](x))
    with pytest.raises(RuntimeError, match="simulated"):
        model[36:](hidden).square().mean().backward()


def test_after_a_raised_backward_a_model_wholly_inside_one_checkpoint_steps_again() -> None:
    # the next backward's first hook runs in a nested task: the raised backward's scope,
    # left open, is closed by the forward in between
    from torch.utils.checkpoint import checkpoint

    ours_model, plain_model = _model(), _model()
    overlapkit.optimizer_in_backward(ours_model, torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01)
    x, y = _batches(2)
    _raise_once(ours_model, x)
    for batch in (y, x):
        batch = batch.clone().requires_grad_()
        checkpoint(ours_model, batch, use_reentrant=True).square().mean().backward()
        plain_model(batch).square().mean().backward()
        plain.step()
        plain.zero_grad()
    assert compare(list(plain_model.parameters()), list(ours_model.parameters()))
    assert all(p.grad is None for p in ours_model.parameters())


def test_a_backward_adding_to_an_unstepped_gradient_is_refused_before_any_step() -> None:
    # no forward of the model in between (its forward() method called directly): the
    # next backward's first parameter adds to the gradient the raised one left
    from overlapkit.errors import ConfigurationError

    model = _model()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    x, y = _batches(2)
    _raise_once(model, x)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigurationError, match="zero_grad"):
        model.forward(y).square().mean().backward()
    assert compare(before, list(model.parameters()))  # nothing stepped
    # the remedy the error names: zero_grad(), then the loop goes on, bitwise
    opt.zero_grad(set_to_none=False)
    plain_model = _model()
    with torch.no_grad():
        for p, q in zip(plain_model.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    model.forward(y).square().mean().backward()
    plain_model(y).square().mean().backward()
    plain.step()
    assert compare(list(plain_model.parameters()), list(model.parameters()))


class _BodyAndHead(nn.Module):
    """A model whose forward runs the body only; the loop applies the head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))
        self.head = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_forward_recomputed_inside_backward_keeps_the_pending_batch() -> None:
    # non-reentrant checkpointing runs the model's own forward (its pre-hooks too) again
    # during backward, while the head's gradients wait in a batch
    from torch.utils.checkpoint import checkpoint

    ours_model, plain_model = _BodyAndHead(), _BodyAndHead()
    overlapkit.optimizer_in_backward(ours_model, torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01)
    for x in _batches(3):
        x = x.clone().requires_grad_()
        ours_model.head(checkpoint(ours_model, x, use_reentrant=False)).square().mean() \
            .backward()
        plain_model.head(plain_model(x)).square().mean().backward()
        plain.step()
        plain.zero_grad()
    assert compare(list(plain_model.parameters()), list(ours_model.parameters()))
