"""Mixed precision, bitwise (2 gloo ranks): the PyTorch fp16 AMP loop
(``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``) with
``grad_scaler=`` and global clipping equals plain DDP + the same GradScaler + the
same clipping (also optimizer_in_backward on FSDP2) — the step where one rank's loss
overflows is skipped on every rank,
``get_scale()`` follows, parameters and optimizer state are equal — for SGD and
AdamW under overlap_ddp (both step threads) and optimizer_in_backward; bf16
parameters equal the plain run; and on a plain module too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import compare, values
from mixed_precision_ranks import OPTIMIZERS, OVERFLOW_STEP, SETUPS, _amp_loop, _model, run

import overlapkit
from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=240)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("setup", [*sorted(SETUPS), "fsdp2"])
def test_grad_scaler_parity_with_an_overflow_on_one_rank(results: list[dict[str, Any]],
                                                          setup: str, optimizer: str) -> None:
    for rank_results in results:
        plain_skipped = rank_results[f"plain {optimizer} skipped"]
        assert plain_skipped[OVERFLOW_STEP] and sum(plain_skipped) == 1  # the case is real
        result = rank_results[f"{setup} {optimizer}"]
        assert result["values"], result["values"]
        assert result["state"], result["state"]
        assert result["scales"][0] == result["scales"][1]
        assert result["skipped"][0] == result["skipped"][1]
        assert result["skipped"][1][OVERFLOW_STEP]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("setup", ["overlap_ddp", "optimizer_in_backward"])
def test_low_precision_parameters_equal_the_plain_run(results: list[dict[str, Any]],
                                                      setup: str, dtype: str) -> None:
    """``model.to(torch.bfloat16 / torch.float16)``: parameters and AdamW state
    bitwise the plain DDP run's (and the run really trained)."""
    for rank_results in results:
        assert rank_results[f"{dtype} {setup}"], rank_results[f"{dtype} {setup}"]
        assert rank_results[f"{dtype} {setup} moved"]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_grad_scaler_on_a_plain_module(optimizer: str) -> None:
    cls, kwargs = OPTIMIZERS[optimizer]
    runs = []
    for overlapped in (False, True):
        model = _model()
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
        opt: Any = (overlapkit.optimizer_in_backward(model, cls, grad_scaler=scaler,
                                                     clip_grad_norm=1.0, **kwargs)
                    if overlapped else cls(model.parameters(), **kwargs))
        runs.append(_amp_loop(model, opt, scaler, 1, plain=not overlapped))
    assert compare(runs[0]["values"], runs[1]["values"])
    assert runs[0]["scales"] == runs[1]["scales"]
    assert runs[0]["skipped"] == runs[1]["skipped"] and runs[0]["skipped"][OVERFLOW_STEP]


def test_grad_scaler_must_be_a_grad_scaler() -> None:
    with pytest.raises(overlapkit.ConfigurationError, match="grad_scaler must be"):
        overlapkit.optimizer_in_backward(_model(), torch.optim.SGD, lr=0.1, grad_scaler=1024)


def test_unknown_clipping_scope() -> None:
    with pytest.raises(overlapkit.ConfigurationError, match="clip_grad_norm_scope must be"):
        overlapkit.optimizer_in_backward(_model(), torch.optim.SGD, lr=0.1,
                                         clip_grad_norm=1.0, clip_grad_norm_scope="layer")


def test_values_helper_sees_the_model() -> None:
    assert len(values(_model())) == 6
