"""``save(..., extra=...)``: the caller's progress inside the checkpoint, complete with it
or not at all (one process, real DCP files; the README script saves its step and LR
schedule this way, and tests/test_nodes.py kills a node half-way through such a save)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from overlapkit import CheckpointError, checkpoint
from overlapkit.checkpoint.extra import EXTRA_FILE
from overlapkit.checkpoint.integrity import MANIFEST_FILE

Trained = tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]


def _trained() -> Trained:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def test_extra_comes_back_exactly_with_the_checkpoint(tmp_path: Path) -> None:
    model, optimizer, scheduler = _trained()
    extra = {"step": 3, "scheduler": scheduler.state_dict(), "best": float("inf"),
             "nothing": None, "tags": ["a", "b"], "nan": float("nan")}
    checkpoint.save(tmp_path / "ckpt", model, optimizer, extra=extra)

    fresh, fresh_optimizer, _ = _trained()
    loaded = checkpoint.load(tmp_path / "ckpt", fresh, fresh_optimizer)
    assert math.isnan(loaded.pop("nan")) and math.isnan(extra.pop("nan"))
    assert loaded == extra
    assert loaded["scheduler"]["_last_lr"] == scheduler.get_last_lr()  # exact floats
    resumed = torch.optim.lr_scheduler.CosineAnnealingLR(fresh_optimizer, T_max=10)
    resumed.load_state_dict(loaded["scheduler"])
    resumed.step()
    scheduler.step()
    assert resumed.get_last_lr() == scheduler.get_last_lr()


def test_extra_is_listed_and_checked_with_the_files(tmp_path: Path) -> None:
    model, optimizer, _ = _trained()
    path = checkpoint.save(tmp_path / "ckpt", model, optimizer, extra={"step": 3})
    listed = json.loads((path / MANIFEST_FILE).read_text())["files"]
    assert EXTRA_FILE in listed
    (path / EXTRA_FILE).write_text(json.dumps({"step": 4}))  # same size, other step
    before = [p.detach().clone() for p in model.parameters()]
    fresh, fresh_optimizer, _ = _trained()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    kept = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(CheckpointError, match=f"its file {EXTRA_FILE} has the size it was "
                                              "saved with but other contents"):
        checkpoint.load(path, fresh, fresh_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh.parameters(), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(before, kept, strict=True))


def test_a_checkpoint_without_extra_gives_an_empty_dict(tmp_path: Path) -> None:
    model, optimizer, _ = _trained()
    checkpoint.save(tmp_path / "ckpt", model, optimizer)
    assert not (tmp_path / "ckpt" / EXTRA_FILE).exists()
    assert checkpoint.load(tmp_path / "ckpt", model, optimizer) == {}


@pytest.mark.parametrize(("extra", "says"), [
    ({"betas": (0.9, 0.99)}, "extra['betas'] is a tuple"),
    ({"steps": {1: 2}}, "extra['steps'] has the key 1 (int)"),
    ({"lr": torch.tensor(0.1)}, "extra['lr'] is a Tensor"),
    ([("step", 1)], "extra must be a dict of plain data, got list"),
])
def test_extra_that_json_would_not_give_back_is_refused_before_writing(
    tmp_path: Path, extra: object, says: str,
) -> None:
    model, optimizer, _ = _trained()
    with pytest.raises(CheckpointError, match=r"\b" + says.replace("[", r"\[").replace(
            "(", r"\(").replace(")", r"\)")):
        checkpoint.save(tmp_path / "ckpt", model, optimizer, extra=extra)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
