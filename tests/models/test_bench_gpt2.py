"""``overlapkit bench --quick --only gpt2``: the GPT-2 benchmark's tiny configuration on
CPU runs every variant (plain DDP + step, overlap_ddp, optimizer_in_backward on DDP,
torch's own overlap) under bf16 autocast, trains to plain's parameters bitwise, and
shows its goal's figure without a verdict (the goal is about GPT-2 small on CUDA).

Runs where transformers is installed (the ``models`` tox environment); skipped
elsewhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "overlapkit", "bench", "--quick", "--only", "gpt2", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[transformers]" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    (only,) = json.loads(proc.stdout)
    return only


def test_the_tiny_gpt2_runs_every_variant_with_step_time_and_peak_memory(
        result: dict[str, Any]) -> None:
    assert result["benchmark"] == "gpt2" and "skipped" not in result
    assert set(result["variants"]) == {"plain", "overlap_ddp", "optimizer_in_backward",
                                       "torch_overlap"}
    for figures in result["variants"].values():
        assert figures["step_ms"] > 0 and figures["peak_rss_mib"] > 0, figures
    assert "GPT-2 tiny" in result["notes"] and "bf16 autocast" in result["notes"]
    assert set(result["ratios"]) == {"overlap_ddp / plain step time",
                                     "optimizer_in_backward / plain step time",
                                     "torch_overlap / plain step time"}


def test_the_overlap_variants_end_with_plain_parameters_bitwise(
        result: dict[str, Any]) -> None:
    diffs = {name: figures["params_max_diff_vs_plain"]
             for name, figures in result["variants"].items()}
    assert diffs["overlap_ddp"] == 0.0 and diffs["optimizer_in_backward"] == 0.0, diffs


def test_the_cuda_goal_is_shown_on_cpu_without_a_verdict(result: dict[str, Any]) -> None:
    from overlapkit.cli.bench.goals import NOT_JUDGED_QUICK

    (record,) = result["goals"]
    assert record["goal"].startswith("gpt2 tiny: overlap_ddp / plain step time")
    assert record["target"] == "<= 1.02"
    assert record["value"] == result["ratios"]["overlap_ddp / plain step time"]
    assert record["met"] is None and record["not_judged"] == NOT_JUDGED_QUICK
