"""docs/huggingface.rst's two complete scripts, their text as the page shows it, run on
2 gloo ranks (the environment ``torchrun`` sets, from ``run_distributed``): with each
technique the model they save is bitwise the one the same script saves with the plain
optimizer (``TECHNIQUE=none``). All runs share one launch of the ranks (each is a fresh
``runpy`` execution of the script as ``__main__``): a ``torchrun`` per run costs an
interpreter and a ``transformers`` import per rank, 20 s each on 2 cores."""

from __future__ import annotations

import os
import re
import runpy
from pathlib import Path
from typing import Any

import pytest
import torch

from overlapkit.distributed import run_distributed

pytestmark = pytest.mark.trainers

PAGE = Path(__file__).resolve().parents[3] / "docs" / "huggingface.rst"
RUNS = {"train_trainer.py": ("none", "optimizer_in_backward", "overlap_ddp"),
        "train_accelerate.py": ("none", "optimizer_in_backward", "overlap_ddp")}


def script(first_line: str) -> str:
    """The code block of the page that starts with ``first_line``, dedented."""
    text = PAGE.read_text(encoding="utf-8")
    for block in re.findall(r"\.\. code-block:: python\n\n((?:   .*\n|\n)+)", text):
        lines = [line[3:] for line in block.splitlines()]
        if lines[0].startswith(first_line):
            return "\n".join(lines).strip() + "\n"
    raise AssertionError(f"no python block starting with {first_line!r} in {PAGE}")


def run_scripts(rank: int, world_size: int, folder: str) -> None:
    """Each script with each technique, one after the other, as ``python script.py``
    would run it (Accelerate's process-wide state cleared between runs)."""
    from accelerate.state import AcceleratorState

    for name, techniques in RUNS.items():
        for technique in techniques:
            os.environ.update(TECHNIQUE=technique, OUTPUT=f"{folder}/{name}-{technique}",
                              STATE=f"{folder}/{name}-{technique}")
            AcceleratorState._reset_state()
            runpy.run_path(f"{folder}/{name}", run_name="__main__")
            torch.distributed.barrier()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    for name in RUNS:
        (folder / name).write_text(script(f"# {name}"), encoding="utf-8")
    run_distributed(run_scripts, 2, args=(str(folder),), timeout=420,
                    env={"HF_HUB_OFFLINE": "1"})
    return folder


def weights(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("name", RUNS)
@pytest.mark.parametrize("technique", ["optimizer_in_backward", "overlap_ddp"])
def test_the_scripts_of_the_page_train_bitwise_as_the_plain_run(
        folder: Path, name: str, technique: str) -> None:
    expected, got = weights(folder / f"{name}-none"), weights(folder / f"{name}-{technique}")
    assert expected.keys() == got.keys()
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
