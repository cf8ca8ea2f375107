"""PyTorch Lightning with overlapkit on one process: OverlapDDPStrategy with devices=1
(both techniques) against ``strategy="ddp"``, and OverlapSingleDeviceStrategy
(optimizer_in_backward of the LightningModule, accumulation under ``no_step()``) against
the default single-device strategy — bitwise, with the same cases as on 2 ranks. What
cannot be honoured on one device is refused; the integration is imported only when used,
and says which extra to install when Lightning is missing."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the `trainers` tox environment installs lightning")

from lightning_parity_ranks import CASES, ONE_PROCESS_REFUSALS, PATCHED_STEP, WARNED, run
from lightning_tuning_ranks import CASES as TUNING
from lightning_tuning_ranks import ONE_DEVICE_ONLY

import overlapkit
from overlapkit.distributed import run_distributed

TUNING_CASES = [*TUNING, "fit twice"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root: Path = tmp_path_factory.mktemp("lightning_one")
    (result,) = run_distributed(run, 1, args=(str(root),), timeout=400)
    return result


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", ["overlap_ddp", "optimizer_in_backward", "one device"])
def test_one_process_trains_bitwise_as_the_plain_strategy(
        results: dict[str, Any], strategy: str, case: str) -> None:
    assert results["parity"][f"{strategy} | {case}"]


MESSAGES = {
    "one device, backward in training_step": "a backward ran outside Lightning's backward",
    "one device, manual optimization": "automatic_optimization = False",
    "the default strategy, an overlapkit optimizer returned": "OverlapSingleDeviceStrategy()",
    "one device, a step patched on the optimizer": PATCHED_STEP,
}


@pytest.mark.parametrize("case", list(ONE_PROCESS_REFUSALS))
def test_what_cannot_be_honoured_on_one_device_is_refused_stepping_nothing(
        results: dict[str, Any], case: str) -> None:
    result = results["refusals"][case]
    error = result["error"]
    assert error is not None and error["overlapkit"], error
    assert MESSAGES[case] in error["message"], error["message"]
    assert result["unchanged"], result["unchanged"]


@pytest.mark.parametrize("options", [
    {"technique": "fsdp"}, {"ddp_comm_hook": lambda state, bucket: None},
    {"model_averaging_period": 4}, {"technique": "optimizer_in_backward",
                                     "step_thread": "comm"},
    {"technique": "optimizer_in_backward", "hooks_read_only_grads": True}])
def test_bad_strategy_options_are_refused_when_the_strategy_is_built(
        options: dict[str, Any]) -> None:
    from overlapkit.integrations.lightning import OverlapDDPStrategy

    with pytest.raises(overlapkit.ConfigurationError):
        OverlapDDPStrategy(**options)


@pytest.mark.parametrize("option", [{"hooks_read_only_grads": True},
                                    {"technique": "overlap_ddp"}, {"comm_hook": "allreduce"}])
def test_an_option_of_the_ddp_strategy_on_one_device_is_refused_by_name(
        option: dict[str, Any]) -> None:
    from overlapkit.integrations.lightning import OverlapSingleDeviceStrategy

    # was Python's TypeError from SingleDeviceStrategy.__init__
    with pytest.raises(overlapkit.ConfigurationError, match=next(iter(option))):
        OverlapSingleDeviceStrategy(**option)


def test_import_overlapkit_imports_no_integration() -> None:
    code = ("import sys, overlapkit; overlapkit.list_plugins; "
            "print(sorted(m for m in sys.modules if m.startswith(('lightning', "
            "'overlapkit.integrations'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_without_lightning_the_import_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name.startswith("overlapkit.integrations."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightning", None)  # import lightning raises
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    with pytest.raises(overlapkit.MissingDependencyError, match=r"overlapkit\[lightning\]"):
        importlib.import_module("overlapkit.integrations.lightning")


@pytest.mark.parametrize("case", list(WARNED))
@pytest.mark.parametrize("strategy", ["overlap_ddp", "optimizer_in_backward", "one device"])
def test_a_fit_working_in_the_window_is_warned_once_where_it_loses_the_overlap(
        results: dict[str, Any], strategy: str, case: str) -> None:
    """Such a fit is stepped in the plain order, with one warning naming what turned the
    overlap off; where the technique keeps what the hook needs, no warning."""
    expected = WARNED[case].get(strategy)
    warned = results["parity"][f"{strategy} | {case} | warnings"]
    if expected is None:
        assert warned == []
    else:
        assert len(warned) == 1 and expected in warned[0], warned


@pytest.mark.parametrize("case", TUNING_CASES)
@pytest.mark.parametrize("strategy", ["overlap_ddp", "optimizer_in_backward", "one device"])
def test_a_fit_after_the_tuners_or_another_fit_trains_bitwise_as_the_plain_strategy(
        results: dict[str, Any], strategy: str, case: str) -> None:
    """The tuner's own fit (and a first fit) releases the optimizer at teardown, so the
    next fit of the same module sets the technique up again: the tuner's results, what it
    set on the module, and the trained parameters are the plain run's."""
    if case in ONE_DEVICE_ONLY and strategy != "one device":
        pytest.skip("Lightning tunes the batch size on one device only")
    assert results["tuning"][f"{strategy} | {case}"]


def test_a_backward_by_hand_after_the_fit_is_a_plain_one(results: dict[str, Any]) -> None:
    result = results["tuning"]["one device | a backward by hand after the fit"]
    assert result["error"] is None and result["grads"], result
    assert result["unchanged"], result["unchanged"]


@pytest.mark.parametrize("case", [c for c in CASES if c not in WARNED])
@pytest.mark.parametrize("strategy", ["overlap_ddp", "optimizer_in_backward", "one device"])
def test_a_fit_reading_no_gradients_keeps_the_overlap_without_a_warning(
        results: dict[str, Any], strategy: str, case: str) -> None:
    assert results["parity"][f"{strategy} | {case} | warnings"] == []


def test_a_layer_of_the_optimizer_unfrozen_during_the_fit_is_stepped_as_in_the_plain_run(
        results: dict[str, Any]) -> None:
    """optimizer_in_backward hooks the parameters that require grad at set-up; one
    unfrozen later turns the rest of the fit to the plain order, with one warning."""
    result = results["parity"]["one device | a callback unfreezes a layer of the optimizer"]
    assert result["bitwise"], result["bitwise"]
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "did not require grad when the fit was set up" in result["warnings"][0]


@pytest.mark.parametrize("strategy", ["overlap_ddp", "optimizer_in_backward", "one device"])
def test_learning_rate_monitor_logs_what_the_plain_strategy_logs(
        results: dict[str, Any], strategy: str) -> None:
    assert results["parity"][f"{strategy} | LearningRateMonitor logs"]
