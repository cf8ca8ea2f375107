"""Step hooks run around the loop's ``step()``: a pre-hook registered on the overlapped
optimizer (``register_step_pre_hook``) or for every optimizer (torch's
``register_optimizer_step_pre_hook``) that clips, adds noise or reads the optimizer's
state, and a post-hook (an EMA of the parameters), have every step taken at ``step()``
in the plain order while registered — bitwise the plain loop, the hook run once per
step and reading the same, one warning — and the steps go back into backward once it is
removed. Plain module (1 process) and DDP (2 gloo ranks), ``overlap_ddp`` (with and
without sharded state) and ``optimizer_in_backward``.

Before (0.4 development) a hook on the optimizer ran around each partial step inside
backward (a bucket, a batch of parameters), on part of the parameters: a clip there was
refused mid-backward, noise hit a freed gradient (a raw ``AttributeError``); a global
pre-hook ran after the step, its clip refused then."""

from __future__ import annotations

from typing import Any

import pytest
from step_hooks_ranks import CASES, SETTINGS, STEPS, run

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def one_process() -> dict[Any, Any]:
    return run_distributed(run, 1, timeout=300, args=(("plain module",),))[0]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[Any, Any]]:
    return run_distributed(run, 2, timeout=400, args=(("DDP", "DDP sharded"),))


def _check(found: dict[str, Any], case: str) -> None:
    assert found["plain error"] is None and found["error"] is None, found
    assert found["bitwise"], found
    mine, plain = found["calls"]
    assert mine == plain == (2 if CASES[case][1] else STEPS), found
    assert found["same log"], found
    assert len(found["warnings"]) == 1, found["warnings"]
    assert "a step hook registered" in found["warnings"][0]


@pytest.mark.parametrize("case", list(CASES))
def test_a_plain_modules_step_pre_hook_runs_before_the_step(
        one_process: dict[Any, Any], case: str) -> None:
    _check(one_process["plain module", "optimizer_in_backward", case], case)


@pytest.mark.parametrize(("setting", "technique", "case"), [
    (setting, technique, case) for setting in ("DDP", "DDP sharded")
    for technique in SETTINGS[setting][1] for case in SETTINGS[setting][2]
    if (setting, case) != ("DDP sharded", "global post-hook EMA")])
def test_a_ddp_step_pre_hook_runs_before_the_step(
        two_ranks: list[dict[Any, Any]], setting: str, technique: str, case: str) -> None:
    for rank_results in two_ranks:
        _check(rank_results[setting, technique, case], case)


def test_a_global_post_hook_is_refused_with_sharded_state_before_a_step(
        two_ranks: list[dict[Any, Any]]) -> None:
    """It would run on each rank's share, before the other ranks' updates arrive (the
    EMA read their old values: not bitwise, before the refusal)."""
    for rank_results in two_ranks:
        found = rank_results["DDP sharded", "overlap_ddp sharded", "global post-hook EMA"]
        assert found["error"]["type"] == "ConfigurationError", found
        assert "register_optimizer_step_post_hook" in found["error"]["message"]
        assert found["stepped before the error"] == 0 and found["unchanged"]
