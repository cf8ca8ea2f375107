"""An optimizer customised where overlapkit cannot see it at its call: its own
``zero_grad`` keeping zero gradients, a ``step()`` requiring a closure, a parameter put
in a second param group by hand, a ``step`` patched on the instance by an LR scheduler
(plain module, 1 process; DDP, 2 gloo ranks; rank code: optimizer_customised_ranks.py).

A subclass of ``AdamW`` whose ``zero_grad`` calls ``super().zero_grad(set_to_none=
False)`` (or such a ``zero_grad`` set on the instance) under ``optimizer_in_backward``:
the loop's ``zero_grad()`` asked for None, the gradients stayed freed where the plain
loop holds zeros, and the layer a forward skipped was not stepped where the plain loop
steps it on its zero gradient (before: 0.0117 off after 4 steps, 0.0068 learnt,
silently). Now it counts as ``zero_grad(set_to_none=False)``: refused at the first
``zero_grad()`` after a stepping backward, nothing changed, or, learnt, every step in
the plain order, bitwise, one warning. ``overlap_ddp`` keeps the gradients: bitwise."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from helpers import each_setting, ranks_fixture
from optimizer_customised_ranks import SETTINGS, run
from torch import nn

from overlapkit.overlap.core.step_hooks import PER_PART_MARK, instance_override

CASES = [
    (setting, technique)
    for setting, (_, techniques) in SETTINGS.items()
    for technique in techniques
]
NAMED = {
    "subclass": "Zeroing.zero_grad() (overriding Optimizer.zero_grad(), it keeps zero",
    "instance patch": "a zero_grad() set on this AdamW (patched_zero_grad.<locals>.zeroing: it",
}


ranks = ranks_fixture(run)


@pytest.mark.parametrize("build", NAMED)
@pytest.mark.parametrize(("setting", "technique"), CASES)
def test_a_zero_grad_keeping_zeros_is_the_plain_loop_once_learnt(
    ranks: list[dict[Any, Any]], setting: str, technique: str, build: str
) -> None:
    for results in each_setting(ranks, setting):
        found = results[setting, technique, build, True]
        assert found["error"] is None and found["bitwise"], found
        if technique == "optimizer_in_backward":
            assert len(found["warnings"]) == 1, found["warnings"]
            assert NAMED[build] in found["warnings"][0]
        else:
            assert found["warnings"] == [], found["warnings"]


@pytest.mark.parametrize("build", NAMED)
@pytest.mark.parametrize(("setting", "technique"), CASES)
def test_a_zero_grad_keeping_zeros_is_refused_after_a_freeing_backward(
    ranks: list[dict[Any, Any]], setting: str, technique: str, build: str
) -> None:
    """Not learnt: ``optimizer_in_backward`` refuses the first ``zero_grad()`` after a
    backward that freed the gradients, nothing changed by it; ``overlap_ddp`` keeps the
    gradients, as the plain loop: bitwise."""
    for results in each_setting(ranks, setting):
        found = results[setting, technique, build, False]
        if technique == "overlap_ddp":
            assert found["error"] is None and found["bitwise"], found
            continue
        error = found["error"]
        assert error is not None and error["overlapkit"], error
        assert NAMED[build] in error["message"] and "learn_first_step" in error["message"]
        assert found["unchanged"] is True, found


@pytest.mark.parametrize(("setting", "technique"), CASES)
def test_an_optimizer_whose_step_requires_a_closure_is_refused_at_set_up(
    ranks: list[dict[Any, Any]], setting: str, technique: str
) -> None:
    """Before: torch's bare ``TypeError: step() missing 1 required positional argument:
    'closure'`` from inside the first backward."""
    for results in each_setting(ranks, setting):
        found = results[setting, technique, "closure"]
        error = found["error"]
        assert error is not None and error["type"] == "UnsupportedOptimizerError", error
        assert "RequiresClosure.step() requires 'closure'" in error["message"]
        assert found["unchanged"], found


@pytest.mark.parametrize("kind", ["closure called", "closure asserted"])
@pytest.mark.parametrize(("setting", "technique"), CASES)
def test_a_step_calling_its_closure_all_the_same_is_refused_as_that(
    ranks: list[dict[Any, Any]], setting: str, technique: str, kind: str
) -> None:
    """``step(closure=None)`` calling ``closure()`` or asserting it: refused as the first
    backward ends, naming the class and the closure, nothing stepped. Before: torch's
    bare ``TypeError: 'NoneType' object is not callable`` (or the ``AssertionError``)
    from inside backward."""
    name = {"closure called": "CallsClosure", "closure asserted": "AssertsClosure"}[kind]
    for results in each_setting(ranks, setting):
        found = results[setting, technique, kind]
        error = found["error"]
        assert error is not None and error["type"] == "UnsupportedOptimizerError", error
        assert f"{name}.step() raised" in error["message"]
        assert "with its closure None" in error["message"]
        assert found["unchanged"], found


@pytest.mark.parametrize(("setting", "technique"), CASES)
def test_a_parameter_put_in_a_second_group_by_hand_is_refused_as_that(
    ranks: list[dict[Any, Any]], setting: str, technique: str
) -> None:
    """At the next backward, nothing stepped in it. Before: refused as parameters added
    by the adopted optimizer's own ``add_param_group()``, telling to call it on the
    overlapped optimizer instead (which refuses a parameter in two groups)."""
    for results in each_setting(ranks, setting):
        found = results[setting, technique, "listed twice"]
        error = found["error"]
        assert error is not None and error["overlapkit"], error
        assert "in more than one param group (#1 of group 0 again as #" in error["message"]
        assert "add_param_group() on" not in error["message"]
        assert found["unchanged"], found


def test_a_step_patch_is_walked_again_once_replaced() -> None:
    """The answer for a ``step`` patched on the instance is kept per patch (an LR
    scheduler's, asked at every backward): a patch replaced, or marked per part, is
    answered anew; the optimizer is not kept alive by it."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    assert instance_override(optimizer) is None
    assert instance_override(optimizer) is None
    saved = optimizer.step

    def noisy(closure: Any = None) -> Any:
        return saved(closure)

    optimizer.step = noisy  # type: ignore[method-assign]
    assert "(test_a_step_patch_is_walked_again_once_replaced.<locals>.noisy)" in str(
        instance_override(optimizer)
    )
    setattr(noisy, PER_PART_MARK, True)
    assert instance_override(optimizer) is None
    optimizer.step = saved  # type: ignore[method-assign]
    assert instance_override(optimizer) is None
    optimizer.step = noisy  # type: ignore[method-assign]
    delattr(noisy, PER_PART_MARK)
    assert instance_override(optimizer) is not None
    kept = weakref.ref(optimizer)
    saved = None  # the bound method the patch calls
    del optimizer, noisy
    gc.collect()
    assert kept() is None


def test_step_with_a_closure_after_a_stepping_backward_says_the_step_was_taken() -> None:
    """258114a: ``loss.backward(); opt.step(closure)`` was refused without saying that
    the backward had stepped the parameters already; called before any backward (torch's
    recipe, the closure running backward) it changes nothing and says nothing of it."""
    import overlapkit

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    x = torch.randn(3, 4)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(overlapkit.ConfigurationError, match="takes no closure") as first:
        opt.step(closure)
    assert "stepped the parameters already" not in str(first.value)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    model(x).square().sum().backward()
    with pytest.raises(overlapkit.ConfigurationError,
                       match=r"stepped the parameters already.*restart from the last"):
        opt.step(closure)
