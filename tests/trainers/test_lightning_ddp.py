"""PyTorch Lightning with overlapkit's OverlapDDPStrategy on 2 gloo ranks (devices=2,
accelerator="cpu"): the same Trainer and LightningModule as with ``strategy="ddp"`` and
plain AdamW — automatic optimization, an LR schedule from configure_optimizers,
gradient_clip_val by norm and by value, accumulate_grad_batches,
GradientAccumulationScheduler, precision="bf16-mixed", a checkpoint and a ckpt_path=
resume — train bitwise the same, with ``overlap_ddp`` and with
``optimizer_in_backward``. What cannot be honoured raises an OverlapkitError, on every
rank.

The ranks are started by overlapkit.distributed.run_distributed (forkserver, free port,
timeout), with the environment Lightning reads (``LOCAL_RANK``, ``WORLD_SIZE``, the
process group already up), so Lightning launches no process itself under pytest;
docs/lightning.rst's script (tests/trainers/test_lightning_docs.py) runs Lightning's own
launcher.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the `trainers` tox environment installs lightning")

from lightning_parity_ranks import CASES, PATCHED_STEP, REFUSALS, WARNED, run
from lightning_tuning_ranks import CASES as TUNING
from lightning_tuning_ranks import ONE_DEVICE_ONLY

from overlapkit.distributed import run_distributed

TECHNIQUES = ["overlap_ddp", "optimizer_in_backward"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root: Path = tmp_path_factory.mktemp("lightning_ddp")
    return run_distributed(run, 2, args=(str(root),), timeout=400)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_the_trainer_trains_bitwise_as_with_strategy_ddp_and_plain_adamw(
        results: list[dict[str, Any]], technique: str, case: str) -> None:
    for rank, rank_results in enumerate(results):
        assert rank_results["parity"][f"{technique} | {case}"], rank


@pytest.mark.parametrize("case", list(WARNED))
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_a_fit_working_in_the_window_is_warned_once_where_it_loses_the_overlap(
        results: list[dict[str, Any]], technique: str, case: str) -> None:
    """Such a fit is stepped in the plain order (what its hooks read is the plain run's,
    in the parity test), with one warning naming what turned the overlap off; where the
    technique keeps what the hook needs (overlap_ddp keeps the gradients), no warning."""
    expected = WARNED[case].get(technique)
    for rank_results in results:
        warned = rank_results["parity"][f"{technique} | {case} | warnings"]
        if expected is None:
            assert warned == []
        else:
            assert len(warned) == 1 and expected in warned[0], warned


@pytest.mark.parametrize("case", [c for c in [*TUNING, "fit twice"] if c not in ONE_DEVICE_ONLY])
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_a_fit_after_the_tuners_or_another_fit_trains_bitwise_as_strategy_ddp(
        results: list[dict[str, Any]], technique: str, case: str) -> None:
    """The tuner's own fit (and a first fit) releases the optimizer at teardown, so the
    next fit of the same module sets the technique up again: the tuner's results and the
    trained parameters are the plain run's, on every rank."""
    for rank, rank_results in enumerate(results):
        assert rank_results["tuning"][f"{technique} | {case}"], rank


@pytest.mark.parametrize("case", [c for c in CASES if c not in WARNED])
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_a_fit_reading_no_gradients_keeps_the_overlap_without_a_warning(
        results: list[dict[str, Any]], technique: str, case: str) -> None:
    for rank_results in results:
        assert rank_results["parity"][f"{technique} | {case} | warnings"] == []


def test_gradient_norms_logged_in_on_before_optimizer_step_keep_the_overlap_when_said(
        results: list[dict[str, Any]]) -> None:
    """overlap_ddp keeps the reduced gradients: with hooks_read_only_grads=True the norms
    Lightning's docs log there are the plain run's, bitwise, the training too, and the
    overlap is kept (no warning)."""
    for rank, rank_results in enumerate(results):
        assert rank_results["parity"]["overlap_ddp | gradient norms logged"], rank


def test_a_plain_fit_of_the_same_module_afterwards_trains_as_a_new_modules(
        results: list[dict[str, Any]]) -> None:
    """optimizer_in_backward frees gradients early through hooks left on the parameters;
    they stop with the overlapkit fit, so a later plain fit is not silently changed."""
    for rank, rank_results in enumerate(results):
        assert rank_results["parity"][
            "optimizer_in_backward | then strategy='ddp' on the same module"], rank


#: refused once a step has been taken: clipping changed during the fit (after its first
#: step). A second backward in one step and a hook changing gradients are refused in the
#: first optimizer step, whose backwards are deferred until it (nothing stepped yet)
AFTER_A_STEP = [case for case in REFUSALS if "changed during" in case]
#: refused at set-up, at the first backward that is not Lightning's, or in the first
#: optimizer step before it steps: nothing stepped
BEFORE_ANY_STEP = [case for case in REFUSALS if case not in AFTER_A_STEP]
MESSAGES = {
    "overlap_ddp, hooks_read_only_grads, a callback changing gradients":
        "ScalesGradients.on_before_optimizer_step changed the gradient of 'net.0.weight'",
    "optimizer_in_backward, backward in training_step": "training_step ran a backward",
    "optimizer_in_backward, gradient_clip_val changed during the fit":
        "gradient_clip_val or gradient_clip_algorithm changed during the fit",
    "optimizer_in_backward, two backwards in LightningModule.backward":
        "a second backward ran before the optimizer step",
    "optimizer_in_backward, manual optimization": "automatic_optimization = False",
    "overlap_ddp, an overlapkit optimizer returned": "return the plain one",
    "overlap_ddp, precision 64-true": "precision='64-true'",
    "overlap_ddp, a step patched on the optimizer": PATCHED_STEP,
    "optimizer_in_backward, a step patched on the optimizer": PATCHED_STEP,
}


def _refused(results: list[dict[str, Any]], case: str) -> list[dict[str, Any]]:
    found = []
    for rank_results in results:
        result = rank_results["refusals"][case]
        error = result["error"]
        assert error is not None and error["overlapkit"], error
        assert MESSAGES[case] in error["message"], error["message"]
        found.append(result)
    return found


@pytest.mark.parametrize("case", BEFORE_ANY_STEP)
def test_what_cannot_be_honoured_is_refused_on_every_rank_before_any_step(
        results: list[dict[str, Any]], case: str) -> None:
    for result in _refused(results, case):
        assert result["unchanged"], result["unchanged"]


@pytest.mark.parametrize("case", AFTER_A_STEP)
def test_what_only_shows_during_training_is_refused_when_it_shows(
        results: list[dict[str, Any]], case: str) -> None:
    """Clipping changed after set-up is refused before the step that would use it."""
    _refused(results, case)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_learning_rate_monitor_logs_what_strategy_ddp_logs(
        results: list[dict[str, Any]], technique: str) -> None:
    """Rank 0 writes the log (Lightning's loggers log on rank 0)."""
    assert results[0]["parity"][f"{technique} | LearningRateMonitor logs"]
