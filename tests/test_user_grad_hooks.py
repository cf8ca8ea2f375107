"""A post-accumulate-grad hook of the loop's own on the parameters (gradient noise, a
gradient-norm logger) sees and changes the gradient the step takes, as before the plain
``step()``, whenever it was registered: before overlapkit's set-up, after it, in the
middle of training, or removed again. Bitwise the plain loop with the same hooks, the
same norms logged, no warning (the overlap stays on). Plain module (1 process), DDP and
FSDP2 (2 gloo ranks), every technique that applies.

Before 0.4 a hook registered after ``optimizer_in_backward``'s set-up ran after the
step, on a gradient already freed: a raw ``AttributeError`` (``'NoneType' object has no
attribute 'mul_'``) from the loop's hook once a step ran inside backward (a 4 MiB batch
on CPU; every parameter on a GPU)."""

from __future__ import annotations

from typing import Any

import pytest
from user_grad_hooks_ranks import SETTINGS, WHEN, run

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def one_process() -> list[dict[str, Any]]:
    return run_distributed(run, 1, timeout=300, args=(("plain module",),))


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=400, args=(("DDP", "FSDP2"),))


def _check(found: dict[str, Any]) -> None:
    assert found["plain error"] is None, found
    assert found["error"] is None, found
    assert found["bitwise"], found
    assert found["same log"] and found["logged"] > 0, found
    assert found["warnings"] == [], found


@pytest.mark.parametrize("when", sorted(WHEN))
def test_a_plain_modules_own_gradient_hooks_run_before_the_step(
        one_process: list[dict[str, Any]], when: str) -> None:
    _check(one_process[0]["plain module", "optimizer_in_backward", when])


@pytest.mark.parametrize("when", sorted(WHEN))
@pytest.mark.parametrize(("setting", "technique"), [
    (setting, technique) for setting in ("DDP", "FSDP2")
    for technique in SETTINGS[setting][2]])
def test_own_gradient_hooks_on_two_ranks_run_before_the_step(
        two_ranks: list[dict[str, Any]], setting: str, technique: str, when: str) -> None:
    for rank_results in two_ranks:
        _check(rank_results[setting, technique, when])
