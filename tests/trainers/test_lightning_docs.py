"""docs/lightning.rst's promise, checked: its script runs as a user runs it
(``python train_lightning.py``, Lightning's own launcher starting the second process),
stops, resumes from its last checkpoint, and ends with the weights and optimizer state
of the same script with ``strategy="ddp"`` run without a stop, bitwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the `trainers` tox environment installs lightning")

import torch

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "lightning.rst").read_text(encoding="utf-8")
OURS = 'strategy=OverlapDDPStrategy(technique="overlap_ddp")'


def _script() -> str:
    """The page's python block (the first), de-indented."""
    block = PAGE.split("\n.. code-block:: python\n", 1)[1]
    lines = []
    for line in block.splitlines()[1:]:
        if line and not line.startswith("   "):
            break
        lines.append(line[3:])
    return "\n".join(lines).strip() + "\n"


def _train(script: Path, checkpoints: Path, max_epochs: int) -> str:
    env = {**os.environ, "CHECKPOINTS": str(checkpoints), "MAX_EPOCHS": str(max_epochs),
           "OMP_NUM_THREADS": "1"}
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # Lightning launches the ranks itself
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=script.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _final(checkpoints: Path) -> dict[str, torch.Tensor]:
    saved = torch.load(checkpoints / "last.ckpt", weights_only=False)
    found = {f"weights.{k}": v for k, v in saved["state_dict"].items()}
    for index, state in saved["optimizer_states"][0]["state"].items():
        found.update({f"optimizer.{index}.{k}": v for k, v in state.items()})
    return found


@pytest.mark.slow
def test_the_lightning_script_resumes_bitwise_the_plain_strategys_run(tmp_path: Path) -> None:
    text = _script()
    assert OURS in text and text.startswith("# train_lightning.py")
    ours, plain = tmp_path / "train_lightning.py", tmp_path / "plain" / "train_lightning.py"
    ours.write_text(text, encoding="utf-8")
    plain.parent.mkdir()
    plain.write_text(text.replace(OURS, 'strategy="ddp"'), encoding="utf-8")

    first = _train(ours, tmp_path / "resumed", max_epochs=2)
    assert "epoch 2: loss" in first
    second = _train(ours, tmp_path / "resumed", max_epochs=4)
    assert "epoch 4: loss" in second
    through = _train(plain, tmp_path / "plain" / "through", max_epochs=4)
    assert second.splitlines()[-1] == through.splitlines()[-1]  # the same loss printed

    expected, got = _final(tmp_path / "plain" / "through"), _final(tmp_path / "resumed")
    assert expected.keys() == got.keys() and any("exp_avg" in k for k in expected)
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert differ == []
