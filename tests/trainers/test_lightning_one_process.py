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

from lightning_parity_ranks import CASES, ONE_PROCESS_REFUSALS, run

import overlapkit
from overlapkit.distributed import run_distributed


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
    "one device, a second fit of the same module": "already trained by an overlapkit strategy",
    "one device, a backward after the fit": "in a fit that has ended",
}


@pytest.mark.parametrize("case", [*ONE_PROCESS_REFUSALS, "one device, a second fit of the "
                                  "same module", "one device, a backward after the fit"])
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
                                     "step_thread": "comm"}])
def test_bad_strategy_options_are_refused_when_the_strategy_is_built(
        options: dict[str, Any]) -> None:
    from overlapkit.integrations.lightning import OverlapDDPStrategy

    with pytest.raises(overlapkit.ConfigurationError):
        OverlapDDPStrategy(**options)


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
