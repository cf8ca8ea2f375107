"""``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` after a backward in which an
overlapped optimizer already stepped is never silently skipped: the clip the optimizer
applied itself (``clip_grad_norm=``, ``clip_grad_value=``) is answered — the norm it
clipped with, bitwise torch's before a plain ``step()`` — and any other raises at the
first call (0.2 clipped nothing and returned 0; Hugging Face's Trainer does this by
default, torchtitan #990). Calls on parameters not stepped since the last ``step()``
are torch's, unchanged."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import compare, rank_batches, values
from late_clipping_ranks import run
from torch import nn

import overlapkit
from overlapkit.distributed import run_distributed
from overlapkit.overlap.rules.late_clipping import FreedGradientNormWarning

LR, CLIP = 0.05, 0.05


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def train(opt_for: Any, clip: Any, steps: int = 4) -> tuple[list[torch.Tensor], list[Any]]:
    """Train ``steps``; ``clip(module)`` runs after each backward; its results."""
    module = model()
    opt = opt_for(module)
    found = []
    for x in rank_batches(0, steps):
        module(x).square().mean().backward()
        found.append(clip(module))
        opt.step()
        opt.zero_grad()
    return values(module), found


def plain(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=LR)


def in_backward(**options: Any) -> Any:
    return lambda module: overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=LR,
                                                           **options)


def clip_norm(max_norm: float) -> Any:
    return lambda module: torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)


def test_the_clip_the_optimizer_applied_returns_its_norm_bitwise_the_plain_loop() -> None:
    expected, plain_norms = train(plain, clip_norm(CLIP))
    ours, norms = train(in_backward(clip_grad_norm=CLIP), clip_norm(CLIP))
    assert compare(expected, ours)
    assert compare(plain_norms, norms)
    assert all(float(n) > CLIP for n in norms)  # clipping was active


def test_a_clip_the_optimizer_did_not_apply_raises_at_the_first_call() -> None:
    with pytest.raises(overlapkit.ConfigurationError, match=r"clip_grad_norm=0\.05") as info:
        train(in_backward(), clip_norm(CLIP))
    assert "taken unclipped" in str(info.value)


def test_another_max_norm_than_the_one_applied_raises() -> None:
    with pytest.raises(overlapkit.ConfigurationError, match=r"max_norm=0\.1"):
        train(in_backward(clip_grad_norm=CLIP), clip_norm(0.1))


def test_a_norm_of_freed_gradients_is_nan_with_a_warning() -> None:
    with pytest.warns(FreedGradientNormWarning, match="freed during backward"):
        _, norms = train(in_backward(), clip_norm(math.inf), steps=1)
    assert math.isnan(float(norms[0]))


def test_a_norm_only_clip_returns_the_applied_norm_but_never_after_the_clip() -> None:
    _, plain_norms = train(plain, clip_norm(CLIP))
    _, alone = train(in_backward(clip_grad_norm=CLIP), clip_norm(math.inf))
    assert compare(plain_norms, alone)  # the norm the optimizer clipped with
    # after the loop's own clip the plain loop returns the clipped gradients' norm,
    # which optimizer_in_backward freed (before the 0.4 probe: the norm before the clip)
    with pytest.warns(FreedGradientNormWarning, match="freed during backward"):
        _, both = train(in_backward(clip_grad_norm=CLIP),
                        lambda m: (clip_norm(CLIP)(m), clip_norm(math.inf)(m)))
    assert all(math.isnan(float(inf)) for _, inf in both)


def test_the_value_clip_the_optimizer_applied_is_a_no_op_and_another_raises() -> None:
    def clip_value(module: nn.Module) -> None:
        torch.nn.utils.clip_grad_value_(module.parameters(), 0.01)

    expected, _ = train(plain, clip_value)
    ours, _ = train(in_backward(clip_grad_value=0.01), clip_value)
    assert compare(expected, ours)
    with pytest.raises(overlapkit.ConfigurationError, match=r"clip_grad_value=0\.01"):
        train(in_backward(), clip_value)


def test_clips_of_other_parameters_and_inside_no_step_are_torchs() -> None:
    other = model()
    stepped = model()
    opt = overlapkit.optimizer_in_backward(stepped, torch.optim.AdamW, lr=LR)
    x = rank_batches(0, 1)[0]
    stepped(x).square().mean().backward()
    other(x).square().mean().backward()
    grads = [p.grad.clone() for p in other.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(other.parameters(), 1e-3)  # not stepped: torch's
    assert compare([torch.nn.utils.get_total_norm(grads)], [norm])
    assert all(float(p.grad.abs().max()) < float(g.abs().max())
               for p, g in zip(other.parameters(), grads, strict=True))
    opt.step()
    with opt.no_step():  # accumulating: the gradients are there, the clip is real
        stepped(x).square().mean().backward()
    before = torch.nn.utils.get_total_norm([p.grad for p in stepped.parameters()])
    assert compare([before], [torch.nn.utils.clip_grad_norm_(stepped.parameters(), 1e-3)])


def test_overlapkit_itself_leaves_torch_clip_functions_its_own_until_first_use() -> None:
    # the guard is installed when the first overlapped optimizer is set up: by then
    # torch.nn.utils holds it, and the function torch defines is untouched
    overlapkit.optimizer_in_backward(model(), torch.optim.SGD, lr=LR)
    from overlapkit.overlap.rules import late_clipping

    assert torch.nn.utils.clip_grad_norm_ is late_clipping.guarded_clip_grad_norm_
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is late_clipping.unguarded_clip_grad_norm_


@pytest.fixture(scope="module")
def ddp_results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=240)


@pytest.mark.parametrize("case", [
    "overlap_ddp answers the clip it applied",
    "optimizer_in_backward answers the clip it applied",
    "overlap_ddp answers a norm-only clip with the gradients' norm",
])
def test_on_ddp_the_applied_clip_is_answered_bitwise(ddp_results: list[dict[str, Any]],
                                                      case: str) -> None:
    for rank_results in ddp_results:
        assert rank_results[case]


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("what", ["refuses a clip it did not apply",
                                  "refuses another max_norm"])
def test_on_ddp_other_clips_raise_on_every_rank(ddp_results: list[dict[str, Any]],
                                                technique: str, what: str) -> None:
    for rank_results in ddp_results:
        error = rank_results[f"{technique} {what}"]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "taken unclipped" in error["message"]
