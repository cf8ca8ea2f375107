"""Lightning fits whose backward runs outside ``optimizer.step(closure=...)`` for another
reason than an ``optimizer_step`` override, at 1 process and 2 gloo ranks (twelfth
round): manual optimization switched on in ``on_train_start`` (``manual_backward``,
``clip_gradients``, ``opt.step()``) and a wrapper set on ``self.optimizers().step``
that runs the closure itself. Both are the plain strategy's fit, bitwise, with one
warning that names what ran the backward (at ``cdd1705`` it blamed "the optimizer_step
override"); manual optimization under ``optimizer_in_backward`` on DDP is refused as its
first ``manual_backward`` starts, the parameters unchanged (at ``cdd1705`` the refusal
came after ``training_step``, its ``opt.step()`` taken, while saying nothing was
stepped). Rank code: lightning_by_hand_ranks.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the `trainers` tox environment installs lightning")

from lightning_by_hand_ranks import MODULES, PAIRS, run

from overlapkit.distributed import run_distributed

#: what the one warning names, by case
NAMED = {"manual optimization from on_train_start": "steps of manual optimization",
         "a wrapper on self.optimizers().step": "set on the instance of self.optimizers()"}


@pytest.fixture(scope="module", params=[1, 2], ids=["1 process", "2 ranks"])
def results(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict[str, Any]]]:
    world_size: int = request.param
    root: Path = tmp_path_factory.mktemp(f"lightning_by_hand_{world_size}")
    return world_size, run_distributed(run, world_size, args=(str(root),), timeout=400)


@pytest.mark.parametrize("case", list(MODULES))
def test_the_fit_is_the_plain_strategys_bitwise_with_one_warning_naming_the_cause(
        results: tuple[int, list[dict[str, Any]]], case: str) -> None:
    world_size, ranks = results
    for rank, rank_results in enumerate(ranks):
        for label in PAIRS[world_size]:
            got = rank_results[f"{label} | {case}"]
            warned = rank_results[f"{label} | {case} | warnings"]
            if isinstance(got, dict):  # refused: see the next test
                assert warned == [], (rank, label, warned)
                continue
            assert got, (rank, label)
            assert len(warned) == 1 and NAMED[case] in warned[0], (rank, label, warned)
            assert "optimizer_step override" not in warned[0], (rank, label, warned)


def test_manual_optimization_under_optimizer_in_backward_on_ddp_is_refused_unstepped(
        results: tuple[int, list[dict[str, Any]]]) -> None:
    _, ranks = results
    for rank_results in ranks:
        got = rank_results["optimizer_in_backward | manual optimization from on_train_start"]
        assert got["error"] is not None and got["error"]["overlapkit"], got
        assert "automatic_optimization was set to False" in got["error"]["message"], got
        assert not got["moved"], got
