"""On a CUDA GPU (skipped without one): the one-process Lightning cases with
``accelerator="gpu"`` (NCCL; optimizer_in_backward steps on a side stream there) train
bitwise as the plain strategy, and Lightning's FSDPStrategy (FSDP1, which Lightning runs
on GPUs only) with an overlapkit optimizer returned from configure_optimizers is refused
before anything changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the `trainers` tox environment installs lightning")
import torch
from lightning_parity_ranks import CASES, gpu_run

from overlapkit.distributed import run_distributed

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root: Path = tmp_path_factory.mktemp("lightning_gpu")
    (result,) = run_distributed(gpu_run, 1, args=(str(root),), timeout=400, backend="nccl")
    fsdp = result["FSDPStrategy, an overlapkit optimizer returned"]["error"]
    print("FSDPStrategy:", fsdp and fsdp["message"])  # shown with -rA
    return result


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", ["overlap_ddp", "optimizer_in_backward", "one device"])
def test_one_gpu_trains_bitwise_as_the_plain_strategy(results: dict[str, Any],
                                                       strategy: str, case: str) -> None:
    assert results["parity"][f"{strategy} | {case}"]


def test_fsdp_strategy_with_an_overlapkit_optimizer_is_refused_before_any_change(
        results: dict[str, Any]) -> None:
    result = results["FSDPStrategy, an overlapkit optimizer returned"]
    error = result["error"]
    assert error is not None and error["overlapkit"], error
    assert "FSDP" in error["message"], error["message"]  # it names what is not supported
    assert result["unchanged"], result["unchanged"]
