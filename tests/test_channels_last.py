"""channels_last convolution weights under DDP (several buckets), both
gradient_as_bucket_view settings: overlap_ddp and optimizer_in_backward equal plain DDP
bitwise (2 gloo ranks). DDP keeps each gradient in its parameter's strides;
GradBucket.gradients() would read it in the wrong order."""

from __future__ import annotations

from typing import Any

import pytest
from channels_last_ranks import run
from helpers import failures

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=120)


@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_channels_last_parity(results: list[dict[str, Any]], technique: str,
                              as_view: bool) -> None:
    assert failures(results, f"{technique} bucket_view={as_view}") == {}
