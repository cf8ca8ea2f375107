"""On a CUDA GPU (skipped without one): ``OverlapTrainer`` and the Accelerate loop with
``optimizer_in_backward``, whose steps run on a side stream there, train bitwise as the
plain ``Trainer`` / loop (bf16 autocast, clipping active, accumulation, a schedule)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_runs import same_run, train

pytestmark = [
    pytest.mark.trainers,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_on_a_gpu_the_trainer_with_optimizer_in_backward_is_bitwise_the_plain_one(
        tmp_path: Path) -> None:
    plain = train(None, "gpt2", str(tmp_path / "plain"), use_cpu=False)
    ours = train("optimizer_in_backward", "gpt2", str(tmp_path / "ours"), use_cpu=False)
    assert next(iter(ours["params"].values())).is_cuda
    assert any(n > 1.0 for n in plain["grad_norms"])
    assert ours["stepped in backward"] and all(ours["stepped in backward"])
    assert same_run(plain, ours)


def test_on_a_gpu_the_accelerate_loop_with_optimizer_in_backward_is_bitwise_the_plain_one(
        ) -> None:
    import accelerate_runs
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    accelerate_runs.CPU = False
    try:
        plain = accelerate_runs.loop(None, "gpt2")
        ours = accelerate_runs.loop("optimizer_in_backward", "gpt2")
    finally:
        accelerate_runs.CPU = True
        AcceleratorState._reset_state(True)
    assert next(iter(ours["params"].values())).is_cuda
    assert ours["stepped in backward"] and all(ours["stepped in backward"])
    assert accelerate_runs.same_run(plain, ours)
