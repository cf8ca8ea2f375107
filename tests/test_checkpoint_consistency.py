"""A checkpoint loads only into the optimizer it fits, whole or not at all: other
parameter groups or another optimizer class are refused before anything changes (they
loaded, then failed with a KeyError at the next step); a file list that leaves a file
out, or no file list with damaged data, still change nothing; an optimizer with state
for some parameters only takes the saved state for all; a stale file or link beside the
checkpoint does not block the next save."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import compare
from torch import nn

from overlapkit import checkpoint
from overlapkit.checkpoint.integrity import MANIFEST_FILE
from overlapkit.errors import CheckpointError


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int = 1) -> None:
    model(torch.randn(5, 16, generator=torch.Generator().manual_seed(seed))
          ).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _everything(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    for index, param in enumerate(p for g in opt.param_groups for p in g["params"]):
        for key, value in opt.state.get(param, {}).items():
            out[f"state {index} {key}"] = torch.as_tensor(value).clone()
    for index, group in enumerate(opt.param_groups):
        out.update({f"group {index} {k}": torch.tensor(float(v)) for k, v in group.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def _by_layer(model: nn.Module) -> list[dict[str, object]]:
    p = dict(model.named_parameters())
    return [{"params": [p["0.weight"], p["0.bias"]], "lr": 0.5},
            {"params": [p["2.weight"], p["2.bias"]], "lr": 0.05}]


def _by_kind(model: nn.Module) -> list[dict[str, object]]:
    p = dict(model.named_parameters())
    return [{"params": [p["0.weight"], p["2.weight"]], "lr": 0.1},
            {"params": [p["0.bias"], p["2.bias"]], "lr": 0.01}]


def test_other_parameter_groups_are_refused_before_anything_changes(tmp_path: Path) -> None:
    model = _net()
    opt = torch.optim.AdamW(_by_layer(model), lr=1.0)
    _step(model, opt)
    checkpoint.save(tmp_path / "ck", model, opt)
    other = _net(1)
    other_opt = torch.optim.AdamW(_by_kind(other), lr=1.0)
    _step(other, other_opt)
    before = _everything(other, other_opt)
    with pytest.raises(CheckpointError, match=r"groups the parameters differently: of param "
                                              r"group 0, only the checkpoint's has '0.bias'"):
        checkpoint.load(tmp_path / "ck", other, other_opt)
    assert compare(before, _everything(other, other_opt))
    _step(other, other_opt)  # and it still trains


@pytest.mark.parametrize(("saved", "loaded", "lacking"), [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), lambda ps: torch.optim.Adam(ps, lr=0.1), "betas"),
    (lambda ps: torch.optim.Adam(ps, lr=0.1),
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "dampening"),
])
@pytest.mark.parametrize("saved_steps", [0, 1])
def test_another_optimizer_class_is_refused_even_without_state(
        tmp_path: Path, saved: object, loaded: object, lacking: str, saved_steps: int) -> None:
    """Also a checkpoint with no optimizer state at all (saved before the first step, or
    from an optimizer that keeps none): it says nothing about state, but its settings
    are another class's."""
    model = _net()
    opt = saved(model.parameters())  # type: ignore[operator]
    for _ in range(saved_steps):
        _step(model, opt)
    checkpoint.save(tmp_path / "ck", model, opt)
    other = _net(1)
    other_opt = loaded(other.parameters())  # type: ignore[operator]
    _step(other, other_opt)
    before = _everything(other, other_opt)
    with pytest.raises(CheckpointError, match="different optimizer") as refused:
        checkpoint.load(tmp_path / "ck", other, other_opt)
    if not opt.state:  # nothing but the settings tells the classes apart
        assert f"'{lacking}'" in str(refused.value)
    assert compare(before, _everything(other, other_opt))


def test_an_optimizer_with_state_for_some_parameters_takes_the_saved_state(
        tmp_path: Path) -> None:
    """A rollback in a run where a branch has not been used yet: the checkpoint has state
    for every parameter, the live optimizer for some; the load gives it all of it."""
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, opt)
    checkpoint.save(tmp_path / "ck", model, opt)
    other = _net(1)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.01)
    other[0](torch.randn(2, 16)).sum().backward()  # only the first layer gets a gradient
    other_opt.step()
    other_opt.zero_grad()
    assert len(other_opt.state) == 2
    checkpoint.load(tmp_path / "ck", other, other_opt)
    assert compare(_everything(model, opt), _everything(other, other_opt))
    _step(model, opt, seed=2)
    _step(other, other_opt, seed=2)
    assert compare(_everything(model, opt), _everything(other, other_opt))


def _saved_and_trained_elsewhere(tmp_path: Path
                                 ) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    model = _net()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    checkpoint.save(tmp_path / "good", model, opt)
    other = _net(5)
    other_opt = torch.optim.AdamW(other.parameters())
    _step(other, other_opt, seed=3)
    return tmp_path / "good", other, other_opt


def _data_file(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)


def test_a_file_list_that_leaves_a_data_file_out_is_refused(tmp_path: Path) -> None:
    good, other, other_opt = _saved_and_trained_elsewhere(tmp_path)
    (good / MANIFEST_FILE).write_text(json.dumps({"version": 1, "files": {}}))
    data = _data_file(good)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    before = _everything(other, other_opt)
    with pytest.raises(CheckpointError, match="damaged"):
        checkpoint.load(good, other, other_opt)
    assert compare(before, _everything(other, other_opt))


def test_data_damaged_in_a_checkpoint_without_file_list_changes_nothing(
        tmp_path: Path) -> None:
    """No file list (torch's DCP, or overlapkit 0.1): the damage is found only while
    reading, after some tensors were read; what they were is put back."""
    good, other, other_opt = _saved_and_trained_elsewhere(tmp_path)
    (good / MANIFEST_FILE).unlink()
    data = _data_file(good)
    raw = bytearray(data.read_bytes())
    raw[-2000:] = os.urandom(2000)
    data.write_bytes(bytes(raw))
    before = _everything(other, other_opt)
    with pytest.raises(CheckpointError):
        checkpoint.load(good, other, other_opt)
    assert compare(before, _everything(other, other_opt))


def test_a_checkpoint_without_file_list_still_loads_exactly(tmp_path: Path) -> None:
    model = _net()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    checkpoint.save(tmp_path / "ck", model, opt)
    (tmp_path / "ck" / MANIFEST_FILE).unlink()
    other = _net(5)
    other_opt = torch.optim.AdamW(other.parameters())
    _step(other, other_opt, seed=3)
    checkpoint.load(tmp_path / "ck", other, other_opt)
    assert compare(_everything(model, opt), _everything(other, other_opt))


@pytest.mark.parametrize("stale", [".ck.saving file", ".ck.old file", ".ck.old link"])
def test_a_stale_sibling_does_not_block_the_next_save(tmp_path: Path, stale: str) -> None:
    model = _net()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    checkpoint.save(tmp_path / "ck", model, opt)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "ck", elsewhere)
    name, kind = stale.split()
    if kind == "file":
        (tmp_path / name).write_text("left over")
    else:
        (tmp_path / name).symlink_to(elsewhere)
    _step(model, opt, seed=2)
    checkpoint.save(tmp_path / "ck", model, opt)
    assert not (tmp_path / name).exists() and not (tmp_path / name).is_symlink()
    assert (elsewhere / ".metadata").is_file()  # a link's target is left alone
    other = _net(5)
    other_opt = torch.optim.AdamW(other.parameters())
    checkpoint.load(tmp_path / "ck", other, other_opt)
    assert compare(_everything(model, opt), _everything(other, other_opt))


def test_inspect_tells_an_intact_checkpoint_from_a_damaged_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from overlapkit.cli import main

    good, _, _ = _saved_and_trained_elsewhere(tmp_path)
    assert checkpoint.inspect(good).integrity == "verified"
    assert main(["checkpoint", "inspect", str(good)]) == 0
    assert "files: verified" in capsys.readouterr().out
    data = _data_file(good)
    data.write_bytes(data.read_bytes()[:100])
    info = checkpoint.inspect(good)
    assert info.integrity == "damaged" and info.problem and "truncated" in info.problem
    assert main(["checkpoint", "inspect", str(good)]) == 1
    assert "DAMAGED:" in capsys.readouterr().err
    (good / MANIFEST_FILE).unlink()
    assert checkpoint.inspect(good).integrity == "damaged"  # too short for its metadata


def test_inspect_names_its_own_signature() -> None:
    with pytest.raises(CheckpointError, match=r"call inspect\(path\)"):
        checkpoint.inspect(None)  # type: ignore[arg-type]
