"""Real architectures, bitwise: tiny GPT-2 (tied weights, a frozen and an integer
parameter), BERT (an unused pooler) and ResNet (BatchNorm buffers) from ``transformers``
configs, trained on 2 gloo ranks with AdamW + an LR scheduler + clipping (by value; by
global norm), by overlap_ddp, optimizer_in_backward and post_local_sgd, against the
plain PyTorch loop each replaces (torch's PostLocalSGDOptimizer for post_local_sgd);
with a checkpoint save and resume in the middle, also under the AMP loop (bf16
autocast, GradScaler, global norm clipping).

Runs where transformers is installed: the ``py311`` and ``models`` tox environments;
skipped elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from helpers import failures
from models_ranks import MODELS, run

from overlapkit.distributed import run_distributed

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")]

#: (model, case) -> the open issue that still makes it differ (strict xfail)
KNOWN: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_results(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    name = request.param
    directory: Path = tmp_path_factory.mktemp(name)
    return name, run_distributed(run, 2, args=(name, str(directory)), timeout=400)


CASES = ["overlap_ddp", "optimizer_in_backward", "post_local_sgd", "plain resumed",
         "overlap_ddp resumed", "optimizer_in_backward resumed", "post_local_sgd resumed",
         "overlap_ddp clip_grad_norm", "optimizer_in_backward clip_grad_norm",
         "post_local_sgd overlapkit.checkpoint", "overlap_ddp GradScaler resumed",
         "optimizer_in_backward GradScaler resumed"]


@pytest.mark.parametrize("case", CASES)
def test_bitwise_the_plain_run(model_results: tuple[str, list[dict[str, Any]]],
                               case: str, request: pytest.FixtureRequest) -> None:
    name, results = model_results
    issue = KNOWN.get((name, case))
    if issue:
        request.applymarker(pytest.mark.xfail(reason=issue, strict=True))
    assert failures(results, case) == {}
