"""A third-party averager's ``before_step`` at later steps, over an overlapped local
optimizer (``optimizer_in_backward``): each such step is taken at ``step()``, after
``before_step``, bitwise the plain loop's (9b5962c: taken during backward, so
``before_step`` read the stepped parameters: 0.030 off after 8 steps, only a
``ParameterReadInWindowWarning``; overlap_ddp alike, 0.008 off in a probe)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import overlapkit

PERIOD, STEPS = 3, 8


class Lookahead:
    """Duck-typed averager, no collective: at each round start ``before_step`` keeps
    (or, ``write``, shrinks) the parameters; after the round's last step
    ``average_parameters`` pulls them halfway back to the kept copy."""

    def __init__(self, write: bool = False) -> None:
        self.step, self.write, self.kept = 0, write, []

    def before_step_at(self, step: int) -> bool:
        return step % PERIOD == 0

    def before_step(self, params: Any) -> None:
        if self.step % PERIOD:
            return
        tensors = [p for group in params for p in group["params"]]
        with torch.no_grad():
            if self.write:
                for p in tensors:
                    p.mul_(0.9)
            self.kept = [p.detach().clone() for p in tensors]

    def average_parameters(self, params: Any) -> bool:
        self.step += 1
        if self.step % PERIOD:
            return False
        with torch.no_grad():
            for p, kept in zip([p for g in params for p in g["params"]], self.kept, strict=True):
                p.copy_(0.5 * p + 0.5 * kept)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class Undeclared(Lookahead):
    before_step_at = None  # type: ignore[assignment]


def _train(overlapped: bool, averager: Lookahead) -> tuple[torch.Tensor, list[str]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    local = (overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1) if overlapped
             else torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = overlapkit.PostLocalSGDOptimizer(local, averager)
        gen = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            x, y = torch.randn(3, 4, generator=gen), torch.randn(3, 2, generator=gen)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, [str(w.message) for w in caught]


@pytest.mark.parametrize("write", [False, True], ids=["reads", "writes"])
def test_before_step_at_later_steps_is_honoured_bitwise(write: bool) -> None:
    plain, _ = _train(False, Lookahead(write))
    overlapped, messages = _train(True, Lookahead(write))
    assert torch.equal(plain, overlapped), float((plain - overlapped).abs().max())
    assert len(messages) <= int(write), messages  # a write: one plain-order warning


def test_before_step_without_before_step_at_takes_every_step_plainly_with_one_warning(
) -> None:
    plain, _ = _train(False, Lookahead())
    overlapped, messages = _train(True, Undeclared())
    assert torch.equal(plain, overlapped), float((plain - overlapped).abs().max())
    assert len(messages) == 1 and "before_step_at" in messages[0], messages


def test_a_model_averager_overriding_before_step_alone_does_not_declare_it() -> None:
    from overlapkit.local_sgd.averagers import ModelAverager, declares_before_step

    class Periodic(ModelAverager):
        def group_for_step(self, step: int) -> Any:
            return None

    class Reads(Periodic):
        def before_step(self, params: Any) -> None:
            pass

    class Says(Reads):
        def before_step_at(self, step: int) -> bool:
            return step == 0

    assert declares_before_step(Periodic())  # before_step does nothing: nothing to defer
    assert not declares_before_step(Reads())
    assert declares_before_step(Says())
    assert not declares_before_step(Undeclared())


def test_a_step_deferred_for_before_step_keeps_the_parameter_names_in_refusals() -> None:
    # before: the deferral called learn_first_step() again, which forgot the model's
    # names: a later refusal said "a parameter of shape (6, 4)" instead of "0.weight"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    local = overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    local.learn_first_step(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = overlapkit.PostLocalSGDOptimizer(local, Lookahead())
        gen = torch.Generator().manual_seed(1)
        with pytest.raises(overlapkit.errors.ConfigurationError) as refused:
            for step in range(STEPS):
                x = torch.randn(3, 4, generator=gen)
                model(x).square().mean().backward()
                if step == PERIOD + 1:  # an overlapped step after a deferred one
                    with torch.no_grad():
                        model[0].weight.clamp_(-0.1, 0.1)
                opt.step()
                opt.zero_grad()
    assert "0.weight" in str(refused.value), str(refused.value)
    assert "a parameter of shape" not in str(refused.value), str(refused.value)
