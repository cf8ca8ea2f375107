"""The "Works with" rows no other test backs, on 2 gloo ranks: bf16 autocast under
overlap_ddp and optimizer_in_backward equals plain DDP bitwise; post_local_sgd under
bf16 autocast, on a torch.compile'd module and with a GradScaler equals torch's
PostLocalSGDOptimizer bitwise."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from helpers import failures
from works_with_ranks import run

from overlapkit.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=300)


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_bf16_autocast_is_bitwise_plain_ddp(results: list[dict[str, Any]],
                                            technique: str) -> None:
    assert failures(results, f"{technique} autocast") == {}


@pytest.mark.parametrize("case", ["autocast", "compiled", "GradScaler"])
def test_post_local_sgd_is_bitwise_torch(results: list[dict[str, Any]], case: str) -> None:
    assert failures(results, f"post_local_sgd {case}") == {}


TECHNIQUE_PAGES = ["ddp_overlap.rst", "optimizer_in_backward.rst", "post_local_sgd.rst"]
ROWS = ["tied weights", "unused parameters", "frozen parameters", "integer parameters",
        "buffers", "torch.compile", "AMP"]


def _works_with_rows(page: str) -> list[str]:
    text = (Path(__file__).parent.parent / "docs" / page).read_text()
    section = text.split("\nWorks with\n", 1)[1]
    table = section.split("\n\n")[2]  # after the heading underline and the intro
    lines = [line for line in table.splitlines() if line and not line.startswith("=")]
    return lines[1:]  # the header row left out


@pytest.mark.parametrize("page", TECHNIQUE_PAGES)
def test_every_works_with_row_names_a_test_that_exists(page: str) -> None:
    rows = _works_with_rows(page)
    for feature in ROWS:
        assert any(feature in row for row in rows), f"{page}: no row for {feature}"
    tests = Path(__file__).parent
    for row in rows:
        named = re.findall(r"``((?:trainers/)?test_\w+\.py|tests/models)``", row)
        assert named, f"{page}: the row {row.split('  ')[0]!r} names no test"
        for name in named:
            path = tests / name.removeprefix("tests/")
            assert path.exists(), f"{page}: {name} does not exist"
