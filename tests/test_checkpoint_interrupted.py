"""A save killed at any instant: :func:`overlapkit.checkpoint.latest` finds the newest
complete checkpoint, every rank gets the same answer, and the next save never throws a
complete checkpoint away for an older one.

Each instant is a real SIGKILL of a process saving to a real directory
(``tests/interrupted_save.py``: step 5 saved, the save of step 10 killed), so the
directories are exactly what a save leaves there; the two-node cases are in
``tests/test_nodes.py``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import error_of
from interrupted_save import INSTANTS
from torch import nn

from overlapkit import checkpoint
from overlapkit.checkpoint.integrity import MANIFEST_FILE
from overlapkit.distributed import run_distributed
from overlapkit.errors import CheckpointError

TESTS = Path(__file__).resolve().parent

#: instant -> (what is left beside NAME, the step of the newest complete checkpoint)
LEFT = {
    "writing the shards": ({".ckpt.saving", "ckpt"}, 5),
    "before the check": ({".ckpt.saving", "ckpt"}, 5),
    "before the file list": ({".ckpt.saving", "ckpt"}, 5),
    "writing the file list": ({".ckpt.saving", "ckpt"}, 5),
    "before the first rename": ({".ckpt.saving", "ckpt"}, 10),
    "between the renames": ({".ckpt.saving", ".ckpt.old"}, 10),
    "removing the old one": ({"ckpt", ".ckpt.old"}, 10),
}


def _killed_saving(directory: Path, instant: str, steps: str = "5,10") -> Path:
    path = directory / "ckpt"
    run = subprocess.run([sys.executable, str(TESTS / "interrupted_save.py"), str(path),
                          instant, steps], capture_output=True, text=True, timeout=120)
    assert run.returncode == -9, (instant, run.returncode, run.stderr[-3000:])
    return path


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _resumed_step(path: Path) -> int:
    """What the README does: ``latest``, then ``load``; the step resumed from, checked
    to hold bitwise the parameters that step saved."""
    assert checkpoint.latest(path) == path
    model, opt = _model()
    step = checkpoint.load(path, model, opt)["step"]
    saved = torch.load(path.parent / f"{path.name}.params-{step}.pt")
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    return int(step)


@pytest.fixture(scope="module", params=INSTANTS)
def killed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, Path, set[str]]:
    """A save of step 10 killed at one instant (step 5 saved before); what it left."""
    directory = tmp_path_factory.mktemp("killed")
    path = _killed_saving(directory, request.param)
    left = {p.name for p in directory.iterdir() if not p.name.endswith(".pt")}
    return request.param, path, left


def test_a_save_killed_at_any_instant_leaves_one_of_the_known_states(
    killed: tuple[str, Path, set[str]],
) -> None:
    instant, _, left = killed
    assert left == LEFT[instant][0]


def test_latest_resumes_from_the_newest_complete_checkpoint_at_any_instant(
    killed: tuple[str, Path, set[str]], tmp_path: Path,
) -> None:
    instant, path, _ = killed
    copy = tmp_path / "copy"
    shutil.copytree(path.parent, copy, symlinks=True)
    assert _resumed_step(copy / "ckpt") == LEFT[instant][1]


def test_the_next_save_never_throws_the_newest_complete_checkpoint_away(
    killed: tuple[str, Path, set[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The next run saves before resuming (as the README did before ``latest``), and
    that save fails before it is complete: the newest complete one is still found."""
    import overlapkit.checkpoint.saving as saving

    instant, path, _ = killed
    copy = tmp_path / "copy"
    shutil.copytree(path.parent, copy, symlinks=True)

    def fail(directory: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(saving, "write_manifest", fail)
    model, opt = _model()
    with pytest.raises(CheckpointError, match="disk full"):
        checkpoint.save(copy / "ckpt", model, opt, extra={"step": 99})
    monkeypatch.undo()
    assert _resumed_step(copy / "ckpt") == LEFT[instant][1]


def test_latest_is_none_before_the_first_save_completes(tmp_path: Path) -> None:
    assert checkpoint.latest(tmp_path / "ckpt") is None
    (tmp_path / "ckpt").mkdir()  # an empty directory is no checkpoint either
    assert checkpoint.latest(tmp_path / "ckpt") is None
    path = _killed_saving(tmp_path, "between the renames", steps="5")  # the first save
    assert checkpoint.latest(path) == path  # its file list was written: complete
    (tmp_path / "second").mkdir()
    path = _killed_saving(tmp_path / "second", "before the file list", steps="5")
    assert checkpoint.latest(path) is None and (path.parent / ".ckpt.saving").is_dir()


def test_latest_refuses_a_path_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not a checkpoint"):
        checkpoint.latest(tmp_path / "results")
    with pytest.raises(CheckpointError, match=r"call latest\(path\)"):
        checkpoint.latest(3)  # type: ignore[arg-type]


# -- a damaged newest checkpoint, and a file list that was deleted ----------------------

@pytest.fixture
def complete(tmp_path: Path) -> Path:
    """A complete checkpoint of step 5 with extra (overlapkit's own file besides the
    list)."""
    path = tmp_path / "ckpt"
    model, opt = _model()
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    torch.save([p.detach() for p in model.parameters()], tmp_path / "ckpt.params-5.pt")
    checkpoint.save(path, model, opt, extra={"step": 5})
    return path


def test_a_checkpoint_whose_file_list_was_deleted_is_refused_naming_it(
    complete: Path,
) -> None:
    (complete / MANIFEST_FILE).unlink()
    model, opt = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=r"its file \.overlapkit-files\.json is missing, "
                       r"where overlapkit's \.overlapkit-extra\.json are there"):
        checkpoint.load(complete, model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(CheckpointError, match=r"\.overlapkit-files\.json: the list is missing"):
        checkpoint.latest(complete)
    info = checkpoint.inspect(complete)
    assert info.integrity == "damaged" and info.problem is not None
    assert ".overlapkit-files.json is missing" in info.problem


def test_latest_refuses_a_damaged_newest_checkpoint_rather_than_go_back(
    complete: Path,
) -> None:
    data = next(complete.glob("*.distcp"))
    data.unlink()
    with pytest.raises(CheckpointError, match=rf"lacks its file {data.name}, which its file "
                       "list names"):
        checkpoint.latest(complete)


def test_inspect_names_what_a_damaged_file_holds_not_the_model_and_optimizer(
    complete: Path,
) -> None:
    data = next(complete.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:10])
    problem = checkpoint.inspect(complete).problem
    assert problem is not None and "model and optimizer" not in problem
    assert f"its file {data.name} has 10 bytes" in problem
    assert "it holds" in problem and "0.weight" in problem
    data.unlink()
    problem = checkpoint.inspect(complete).problem
    assert problem is not None and f"its file {data.name} is missing" in problem
    # the load says what it left unchanged: here only a model was passed
    model, _ = _model()
    error = error_of(lambda: checkpoint.load(complete, model))
    assert error is not None and "the model is as it was" in error["message"]


# -- every rank the same answer ---------------------------------------------------------

def _latest_on_ranks(rank: int, world_size: int, paths: list[str]) -> dict[str, Any]:
    error = error_of(lambda: checkpoint.latest(paths[rank]))
    return {"error": error}


def test_latest_raises_on_every_rank_when_the_ranks_see_different_checkpoints(
    complete: Path, tmp_path: Path,
) -> None:
    """Rank 1 looks at another directory (as a node with its own disk would): every
    rank raises, naming what each saw, and nobody resumes."""
    results = run_distributed(_latest_on_ranks, 2, timeout=120,
                              args=([str(complete), str(tmp_path / "elsewhere")],))
    for result in results:
        error = result["error"]
        assert error is not None and error["type"] == "CheckpointError", error
        assert "the ranks do not find the same checkpoint" in error["message"]
        assert "rank 0 (" in error["message"] and "rank 1 (" in error["message"]
        assert "sees no checkpoint at" in error["message"]
        assert "storage every node sees" in error["message"]


def test_latest_follows_a_link_at_the_path_but_never_moves_a_linked_leftover(
    complete: Path, tmp_path: Path,
) -> None:
    link = tmp_path / "current"
    link.symlink_to(complete)
    assert checkpoint.latest(link) == link
    aside = tmp_path / ".gone.old"  # a link left where a save puts the previous one
    aside.symlink_to(complete)
    assert checkpoint.latest(tmp_path / "gone") is None
    assert (complete / MANIFEST_FILE).is_file()  # the link's target is left alone
