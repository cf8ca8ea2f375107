"""Single-process checkpoint behaviour: errors, safe unpickling, atomic saves, inspect.

Plain modules in the test process (DCP loads and saves without a process group), real
DCP directories in tmp_path; the killed save is a real SIGKILL of a real subprocess.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import on_each_real_step
from torch import nn

import overlapkit
from overlapkit import checkpoint
from overlapkit.checkpoint.integrity import MANIFEST_FILE
from overlapkit.cli import main
from overlapkit.errors import CheckpointError, UnknownNameError


def make(seed: int = 0, width: int = 16, optimizer: type = torch.optim.AdamW
         ) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))
    opt = optimizer(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    path = tmp_path_factory.mktemp("ckpt") / "step-1"
    model, opt = make()
    checkpoint.save(path, model, opt)
    return path, model, opt


@pytest.fixture
def copy_of(saved: tuple[Path, nn.Module, torch.optim.Optimizer], tmp_path: Path) -> Path:
    path = tmp_path / "copy"
    shutil.copytree(saved[0], path)
    return path


def test_checkpoint_is_reachable_as_an_attribute_of_the_package() -> None:
    assert overlapkit.checkpoint is checkpoint
    assert "checkpoint" in overlapkit.__all__


def test_plain_model_roundtrip_is_exact_even_with_gradients_present(
    saved: tuple[Path, nn.Module, torch.optim.Optimizer],
) -> None:
    path, model, opt = saved
    other, other_opt = make(seed=5)
    other(torch.randn(4, 8)).sum().backward()  # grads present, state empty below
    other_opt.state.clear()
    checkpoint.load(path, other, other_opt)
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == other_opt.state[q].keys()
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], other_opt.state[q][key])
    assert all(q.grad is not None for q in other.parameters())  # put back untouched


# -- errors ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["missing", "empty dir", "file"])
def test_no_checkpoint_at_path(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "nothing"
    if kind == "empty dir":
        path.mkdir()
    elif kind == "file":
        path.write_text("x")
    model, opt = make()
    with pytest.raises(CheckpointError, match=r"checkpoint\.save|not a checkpoint") as err:
        checkpoint.load(path, model, opt)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_truncated_or_corrupt_metadata(copy_of: Path, damage: str) -> None:
    meta = copy_of / ".metadata"
    data = meta.read_bytes()
    meta.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x80\x04junk" * 9,
                      "empty": b""}[damage])
    model, opt = make()
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        checkpoint.load(copy_of, model, opt)


def test_shape_mismatch_names_the_tensor_and_both_shapes(
    saved: tuple[Path, nn.Module, torch.optim.Optimizer],
) -> None:
    model, opt = make(width=32)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(saved[0], model, opt)
    assert "'model.0.bias' has shape (16,) in the checkpoint" in str(err.value)
    assert "but (32,) here" in str(err.value)


def test_different_optimizer_lists_the_missing_optimizer_keys(
    saved: tuple[Path, nn.Module, torch.optim.Optimizer],
) -> None:
    model, opt = make(optimizer=torch.optim.Adagrad)
    with pytest.raises(CheckpointError, match="different optimizer") as err:
        checkpoint.load(saved[0], model, opt)
    assert "optimizer.state.0.bias.sum" in str(err.value)
    assert "same optimizer class" in str(err.value)


def test_checkpoint_without_optimizer_state(tmp_path: Path) -> None:
    model, opt = make()
    checkpoint.save(tmp_path / "model-only", model)
    with pytest.raises(CheckpointError, match="no 'optimizer' entries"):
        checkpoint.load(tmp_path / "model-only", model, opt)
    checkpoint.load(tmp_path / "model-only", model)  # the model alone loads


def test_missing_optimizer_key_in_load_sharded_optimizer_state_dict(
    saved: tuple[Path, nn.Module, torch.optim.Optimizer],
) -> None:
    import torch.distributed.checkpoint as dcp

    with pytest.raises(CheckpointError, match="no optimizer state under 'optim'") as err:
        checkpoint.load_sharded_optimizer_state_dict(
            saved[1].state_dict(), "optim", dcp.FileSystemReader(saved[0]))
    assert "['model', 'optimizer']" in str(err.value)


def test_checkpoint_from_a_different_model_lists_missing_and_unexpected(
    saved: tuple[Path, nn.Module, torch.optim.Optimizer],
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
    with pytest.raises(CheckpointError, match="from a different model") as err:
        checkpoint.load(saved[0], model, torch.optim.AdamW(model.parameters()))
    message = str(err.value)
    assert "missing from the checkpoint: 'model.3.bias', 'model.3.weight'" in message
    assert "Build the same model" in message


def test_dcp_failure_becomes_a_checkpoint_error(copy_of: Path) -> None:
    # DCP raises CheckpointException, a BaseException, when a data file cannot be read
    # (zeroed, in a checkpoint without overlapkit's file list, which would name the file
    # first; its size is right, so the size check from the metadata lets it through)
    for data_file in copy_of.glob("*.distcp"):
        data_file.write_bytes(bytes(data_file.stat().st_size))
    (copy_of / MANIFEST_FILE).unlink()
    model, opt = make()
    with pytest.raises(CheckpointError, match=r"failed on ranks \[0\]"):
        checkpoint.load(copy_of, model, opt)


def test_a_missing_data_file_without_the_file_list_is_named(copy_of: Path) -> None:
    for data_file in copy_of.glob("*.distcp"):
        data_file.unlink()
    (copy_of / MANIFEST_FILE).unlink()
    model, opt = make()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=r"its file __0_0\.distcp is missing"):
        checkpoint.load(copy_of, model, opt)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_save_refuses_to_replace_something_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "keep.txt").write_text("precious")
    model, opt = make()
    with pytest.raises(CheckpointError, match="exists and is not a checkpoint"):
        checkpoint.save(tmp_path / "results", model, opt)
    assert (tmp_path / "results" / "keep.txt").read_text() == "precious"


# -- safe unpickling -------------------------------------------------------------------

class _Payload:
    """Unpickling this creates a directory: the stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def test_metadata_with_a_foreign_class_is_refused_and_never_run(
    copy_of: Path, tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    metadata = checkpoint.read_metadata(copy_of)
    metadata.planner_data["evil"] = _Payload(marker)
    (copy_of / ".metadata").write_bytes(pickle.dumps(metadata))
    model, opt = make()
    with pytest.raises(CheckpointError, match=r"refers to posix\.mkdir"):
        checkpoint.load(copy_of, model, opt)
    with pytest.raises(CheckpointError, match="refuses to unpickle"):
        checkpoint.inspect(copy_of)
    with pytest.raises(CheckpointError, match="refuses to unpickle"):  # torch's reader swapped
        checkpoint.load_sharded_optimizer_state_dict(
            model.state_dict(), "optimizer", dcp.FileSystemReader(copy_of))
    assert not marker.exists()


def test_non_tensor_entry_with_a_foreign_object_is_refused_and_never_run(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    marker = tmp_path / "ran"
    model, opt = make()
    model_sd, optim_sd = get_state_dict(model, opt)
    optim_sd["param_groups"][0]["lr"] = _Payload(marker)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp_path / "evil")
    with pytest.raises(CheckpointError, match=r"'optimizer\.param_groups\.0\.lr' is not a plain"):
        checkpoint.load(tmp_path / "evil", model, opt)
    assert not marker.exists()


def test_every_class_in_real_metadata_is_allowed(
    saved: tuple[Path, nn.Module, torch.optim.Optimizer],
) -> None:
    data = (saved[0] / ".metadata").read_bytes()
    assert checkpoint.SafeUnpickler.__module__ == "overlapkit.checkpoint.metadata"
    assert checkpoint.read_metadata(saved[0]) == pickle.loads(data)


# -- atomic saves ----------------------------------------------------------------------

_SAVER = """
import sys, torch
from torch import nn
from overlapkit import checkpoint
torch.manual_seed(1)
model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(24)])
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 512)).sum().backward(); opt.step()
print("saving", flush=True)
checkpoint.save(sys.argv[1], model, opt)
print("saved", flush=True)
"""


def _big_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(24)])
    return model, torch.optim.AdamW(model.parameters())


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    path = tmp_path / "latest"
    previous, previous_opt = _big_model(seed=0)
    previous(torch.randn(2, 512)).sum().backward()
    previous_opt.step()
    checkpoint.save(path, previous, previous_opt)

    saver = subprocess.Popen([sys.executable, "-c", _SAVER, str(path)],
                             stdout=subprocess.PIPE, text=True)
    assert saver.stdout is not None and saver.stdout.readline().strip() == "saving"
    partial = tmp_path / ".latest.saving"
    deadline = time.monotonic() + 60
    while not any(partial.glob("*.distcp")) and time.monotonic() < deadline:
        time.sleep(0.001)
    saver.send_signal(signal.SIGKILL)
    saver.wait()
    assert saver.returncode == -signal.SIGKILL
    assert partial.is_dir() and not (partial / ".metadata").exists()  # killed mid-way

    model, opt = _big_model(seed=3)
    checkpoint.load(path, model, opt)
    for p, q in zip(previous.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(previous_opt.state[p]["exp_avg"], opt.state[q]["exp_avg"])

    checkpoint.save(path, model, opt)  # the next save clears the partial one
    assert not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_save_replaces_a_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    first, first_opt = make(seed=0)
    checkpoint.save(path, first, first_opt)
    second, second_opt = make(seed=1)
    checkpoint.save(path, second, second_opt)
    model, opt = make(seed=2)
    checkpoint.load(path, model, opt)
    assert torch.equal(model[0].weight, second[0].weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_save_interrupted_between_its_renames_is_recovered(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    model, opt = make(seed=0)
    checkpoint.save(path, model, opt)
    path.rename(tmp_path / ".ckpt.old")  # where the swap leaves it, had it died there
    with pytest.raises(CheckpointError, match=r"a complete checkpoint is at .*\.ckpt\.old"):
        checkpoint.load(path, model, opt)
    checkpoint.save(path, *make(seed=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# -- a save leaves training as it was ----------------------------------------------------

def _train_from_fresh(optim_cls: type, options: dict[str, Any], save_to: Path | None,
                      load_from: Path | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0 if load_from is None else 5)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = optim_cls(model.parameters(), lr=0.05, **options)
    if save_to is not None:
        checkpoint.save(save_to, model, opt)
        assert not opt.state
    if load_from is not None:
        checkpoint.load(load_from, model, opt)
        assert not opt.state, "a checkpoint saved before the first step gave state"
    batches = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(4, 8, generator=batches)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()] + [
        value for p in model.parameters() for value in opt.state[p].values()]


@pytest.mark.parametrize(("optim_cls", "options"), [
    (torch.optim.Adam, {}),
    (torch.optim.SGD, {"momentum": 0.9, "dampening": 0.5}),
], ids=["Adam", "SGD-momentum"])
def test_saving_a_fresh_optimizer_does_not_change_its_training(
    tmp_path: Path, optim_cls: type, options: dict[str, Any]
) -> None:
    # The state a save creates (Adam step 1, SGD momentum buffer 0) would make the
    # first real step a second one: bias correction of step 2, (1 - dampening) * grad.
    without = _train_from_fresh(optim_cls, options, None)
    with_save = _train_from_fresh(optim_cls, options, tmp_path / "fresh")
    assert len(with_save) == len(without)
    for a, b in zip(without, with_save, strict=True):
        assert torch.equal(a, b)
    # Resumed from that checkpoint, the first step is a first step too (the saved
    # checkpoint held Adam step 1 and zero moments on main: 0.07 off after 2 steps).
    resumed = _train_from_fresh(optim_cls, options, None, load_from=tmp_path / "fresh")
    assert len(resumed) == len(without)
    for a, b in zip(without, resumed, strict=True):
        assert torch.equal(a, b)


def test_saving_a_state_free_optimizer_does_not_step_it_once_per_parameter(
    tmp_path: Path,
) -> None:
    model, opt = make(optimizer=torch.optim.SGD)
    devices: list[str] = []  # of the parameters stepped: meta for a layout-only step
    opt.register_step_post_hook(
        lambda o, *_: devices.append(o.param_groups[0]["params"][0].device.type))
    checkpoint.save(tmp_path / "sgd", model, opt)
    # torch's get_state_dict itself steps once (learning rate 0) when nothing has state
    assert devices.count("cpu") <= 1 < len(list(model.parameters()))


@pytest.mark.parametrize("optim_cls", [torch.optim.SGD, torch.optim.Adam])
def test_a_save_or_load_between_a_stepping_backward_and_step_is_refused_once_the_loop_steps(
    tmp_path: Path, optim_cls: type
) -> None:
    # In the plain loop a save there keeps the parameters before this step and a load
    # is stepped from by the step() after it; here the backward has stepped already.
    # The first window is the loop's own (nothing learned yet: a backward-only loop has
    # no step() to come), so a save there is taken and leaves step() a no-op.
    def train(with_checkpoints: bool) -> tuple[list[torch.Tensor], list[int], list[str]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        opt = overlapkit.optimizer_in_backward(model, optim_cls, lr=0.05)
        real_steps: list[int] = []
        on_each_real_step(opt, lambda _: real_steps.append(1))
        batches = torch.Generator().manual_seed(1)
        steps_in_step, refusals = [], []
        for i in range(3):
            model(torch.randn(4, 8, generator=batches)).square().mean().backward()
            if with_checkpoints:
                before = [p.detach().clone() for p in model.parameters()]
                try:
                    if i == 1:
                        checkpoint.load(tmp_path / "oib", model, opt)
                    else:
                        checkpoint.save(tmp_path / f"oib-{i}", model, opt)
                except CheckpointError as error:
                    refusals.append(str(error))
                    assert all(torch.equal(p, q) for p, q in zip(
                        before, model.parameters(), strict=True))
            before_step = len(real_steps)
            opt.step()  # the backward stepped: nothing left to do
            steps_in_step.append(len(real_steps) - before_step)
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], steps_in_step, refusals

    params, steps_in_step, _ = train(with_checkpoints=False)
    assert steps_in_step == [0, 0, 0]
    checkpointed, steps_in_step, refusals = train(with_checkpoints=True)
    assert steps_in_step == [0, 0, 0]
    assert (tmp_path / "oib-0").is_dir() and not (tmp_path / "oib-2").exists()
    assert len(refusals) == 2
    assert all("between backward() and optimizer.step()" in r and "Nothing was written" in r
               for r in refusals), refusals
    for p, q in zip(params, checkpointed, strict=True):
        assert torch.equal(p, q)


# -- planners ---------------------------------------------------------------------------

def test_builtin_load_planners_are_registered(overlapkit_plugin_manager) -> None:
    registry = overlapkit_plugin_manager.registry
    assert registry.provided_by("overlapkit.checkpoint") == {
        "load_planners": ["default", "offset_2d"]}
    assert [s.name for s in registry.load_planners_by_priority()] == ["offset_2d", "default"]


def test_planner_is_chosen_from_the_layout_or_by_name(overlapkit_plugin_manager) -> None:
    from overlapkit.checkpoint.planners import resolve_load_planner

    plain = nn.Linear(2, 2).state_dict()
    name, planner = resolve_load_planner(None, plain)
    assert (name, type(planner)) == ("default", checkpoint.SafeLoadPlanner)
    name, planner = resolve_load_planner("offset-2d", plain)
    assert (name, type(planner)) == ("offset_2d", checkpoint.OffsetLoadPlanner)
    with pytest.raises(UnknownNameError, match="'default', 'offset_2d'"):
        resolve_load_planner("nope", plain)


def test_load_with_an_unknown_planner_name_fails_before_reading(
    saved: tuple[Path, nn.Module, torch.optim.Optimizer],
) -> None:
    model, opt = make(seed=4)
    with pytest.raises(UnknownNameError):
        checkpoint.load(saved[0], model, opt, planner="nope")


# -- inspect -----------------------------------------------------------------------------

def test_inspect_lists_tensors_shapes_dtypes_and_size(
    saved: tuple[Path, nn.Module, torch.optim.Optimizer],
) -> None:
    info = checkpoint.inspect(saved[0])
    by_key = {e.key: e for e in info.entries}
    weight = by_key["optimizer.state.0.weight.exp_avg"]
    assert (weight.kind, weight.shape, weight.dtype) == ("tensor", (16, 8), "torch.float32")
    assert weight.chunks == (((0, 0), (16, 8)),)
    assert weight.stored_bytes >= 16 * 8 * 4
    assert by_key["optimizer.param_groups.0.lr"].kind == "value"
    assert info.size_on_disk == sum(f.stat().st_size for f in saved[0].iterdir())


def test_cli_inspect_table_and_json(
    saved: tuple[Path, nn.Module, torch.optim.Optimizer], capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["checkpoint", "inspect", str(saved[0])]) == 0
    table = capsys.readouterr().out
    assert "16 tensors" in table and "model.0.weight" in table and "(16, 8)" in table
    assert main(["checkpoint", "inspect", "--json", str(saved[0])]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tensor_count"] == 16
    assert {"key", "shape", "dtype", "chunks", "stored_bytes"} <= set(data["entries"][0])


def test_cli_inspect_missing_path_is_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["checkpoint", "inspect", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("overlapkit: error: no checkpoint at") and "Traceback" not in err
