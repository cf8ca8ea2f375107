"""PyTorch's upstream overlap tests on ResNet-50, as upstream runs them where
torchvision is installed (torchvision does not import beside this project's torch
build; the ResNet-50 here is transformers' ``ResNetConfig()`` default, the same
bottleneck layout: depths 3-4-6-3, widths 256-2048, 25.6 M parameters). A subset of
tests/test_upstream_overlap.py's cases, on an input of shape ``(1, 3, 3, 1000)``
(upstream's for the parity test; its 1000 x 1000 image for the in-backward test would
take minutes per step on a CPU).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

pytest.importorskip("transformers")

from upstream_overlap_ranks import ddp_apply_optim_in_backward, hook_with_optimizer_parity

from overlapkit.distributed import run_distributed

pytestmark = [pytest.mark.models, pytest.mark.slow]

PARITY = list(itertools.product(("adamw",), (True, False), (True, False), (False,)))


def resnet50() -> Any:
    """ResNet-50 returning its logits (upstream calls ``out.sum()``)."""
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = ResNetForImageClassification(ResNetConfig())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(pixel_values=x).logits  # type: ignore[no-any-return]

    return Logits()


def _run(rank: int, world_size: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(rank)
    model, inp = resnet50(), torch.randn(1, 3, 3, 1000)
    out: dict[str, Any] = {}
    for case in PARITY:
        out[f"parity {case}"] = hook_with_optimizer_parity(rank, *case, model=model, inp=inp)
    out["apply"] = ddp_apply_optim_in_backward(
        rank, "SGD", False, True, models=[(resnet50(), (1, 3, 3, 1000))])
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_run, 2, timeout=900)


@pytest.mark.parametrize("case", [f"parity {case}" for case in PARITY])
def test_ddp_hook_with_optimizer_parity_on_resnet50(results: list[dict[str, Any]],
                                                    case: str) -> None:
    for rank_results in results:
        result = rank_results[case]
        assert result["initially"] and result["equal"], result["equal"]
        assert result["first moved"]


def test_ddp_apply_optim_in_backward_on_resnet50(results: list[dict[str, Any]]) -> None:
    for rank_results in results:
        result = rank_results["apply"]["model 0"]
        assert result["initially"]
        assert all(result["equal"]), result["equal"]
        assert all(result["grads none"])
