"""Lion itself, in one process: the update rule and its argument checks."""

from __future__ import annotations

import pytest
import torch

from overlapkit_lion import Lion


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]


def _run(foreach: bool, steps: int = 4) -> list[torch.Tensor]:
    params = _params()
    opt = Lion(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1, foreach=foreach)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


def test_foreach_and_per_parameter_steps_are_bitwise_equal() -> None:
    for a, b in zip(_run(True), _run(False), strict=True):
        assert torch.equal(a, b)


def test_one_step_follows_the_published_rule() -> None:
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    grad = torch.tensor([0.3, -0.1, 0.0])
    opt = Lion([param], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    param.grad = grad
    opt.step()
    # m starts at 0: c = 0.1 * g, so the step is sign(g); decay multiplies by 1 - 0.1 * 0.5.
    expected = torch.tensor([1.0, -2.0, 0.5]) * 0.95 - 0.1 * torch.sign(grad)
    assert torch.allclose(param.detach(), expected)
    assert torch.allclose(opt.state[param]["exp_avg"], 0.01 * grad)


def test_parameters_without_gradient_are_left_alone() -> None:
    params = _params()
    before = params[1].detach().clone()
    params[0].grad = torch.ones_like(params[0])
    Lion(params, lr=0.1).step()
    assert torch.equal(params[1].detach(), before)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"lr": 0.0}, "lr > 0"), ({"betas": (0.9, 1.0)}, "0 <= beta < 1"),
     ({"weight_decay": -1.0}, "weight_decay >= 0")],
)
def test_bad_arguments_say_what_is_expected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Lion(_params(), **kwargs)  # type: ignore[arg-type]
