"""A load planner plugin whose plan leaves entries out or reads a tensor in part is
refused before anything is read, naming the planner and the entries (f2b92e2: loaded
silently, the entries left out keeping their values: the model off the saved one, or
the optimizer's lr 0.02 where 0.01 was saved). A planner instance passed by the caller
is used as DCP uses it, unchecked."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

import overlapkit
from overlapkit import checkpoint
from overlapkit.checkpoint.planners import SafeLoadPlanner
from overlapkit.errors import CheckpointError


def _drop_weight(item: ReadItem) -> list[ReadItem]:
    return [] if item.dest_index.fqn == "model.0.weight" else [item]


def _half_weight(item: ReadItem) -> list[ReadItem]:
    if item.dest_index.fqn != "model.0.weight":
        return [item]
    return [dataclasses.replace(item, lengths=torch.Size([item.lengths[0] // 2,
                                                          *item.lengths[1:]]))]


def _drop_lr(item: ReadItem) -> list[ReadItem]:
    return [] if item.dest_index.fqn == "optimizer.param_groups.0.lr" else [item]


def _twice(item: ReadItem) -> list[ReadItem]:
    return [item, item] if item.dest_index.fqn == "model.2.bias" else [item]


EDITS = {"drops a weight": (_drop_weight, "leaves out 1 entries ('model.0.weight')"),
         "reads half a weight": (_half_weight, "'model.0.weight' (12 of 24 elements)"),
         "drops the lr": (_drop_lr, "leaves out 1 entries ('optimizer.param_groups.0.lr')"),
         "reads a bias twice": (_twice, "'model.2.bias' (4 of 2 elements)")}


class _Edited(SafeLoadPlanner):
    def __init__(self, edit: Any, **options: Any) -> None:
        super().__init__(**options)
        self.edit = edit

    def create_local_plan(self) -> LoadPlan:
        items = super().create_local_plan().items
        return LoadPlan([new for item in items for new in self.edit(item)])


@overlapkit.hookimpl
def overlapkit_register_load_planners() -> list[overlapkit.LoadPlannerRecord]:
    def build(edit: Any) -> Any:
        return lambda **options: _Edited(edit, **{k: v for k, v in options.items()
                                                  if k != "fqn_to_offset"})
    return [overlapkit.LoadPlannerRecord(name=name.replace(" ", "_"), build=build(edit))
            for name, (edit, _) in EDITS.items()]


class _Plugin:
    overlapkit_register_load_planners = staticmethod(overlapkit_register_load_planners)


def _make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    return [t.clone() for t in model.state_dict().values()] + [
        v.clone() if isinstance(v, torch.Tensor) else v
        for s in opt.state.values() for v in s.values()] + [opt.param_groups[0]["lr"]]


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("case", list(EDITS))
def test_a_planner_plugin_reading_the_wrong_entries_is_refused_nothing_loaded(
        overlapkit_plugin_manager: Any, tmp_path: Path, case: str) -> None:
    overlapkit_plugin_manager.register(_Plugin(), name="bad-planners")
    checkpoint.save(tmp_path / "ck", *_make(0))
    model, opt = _make(1)
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError) as refused:
        checkpoint.load(tmp_path / "ck", model, opt, planner=case.replace(" ", "_"))
    message = str(refused.value)
    assert f"load planner {case.replace(' ', '_')!r}" in message and EDITS[case][1] in message
    assert "Nothing was loaded" in message
    assert _same(_snapshot(model, opt), before)


def test_registered_planners_and_an_instance_load_as_before(
        overlapkit_plugin_manager: Any, tmp_path: Path) -> None:
    saved = _make(0)
    checkpoint.save(tmp_path / "ck", *saved)
    for planner in ("default", None, _Edited(_drop_lr)):
        model, opt = _make(1)
        checkpoint.load(tmp_path / "ck", model, opt, planner=planner)
        loaded = _snapshot(model, opt)
        if isinstance(planner, _Edited):  # the caller's own: unchecked, as DCP
            assert loaded[-1] == 0.02 and _same(loaded[:-1], _snapshot(*saved)[:-1])
        else:
            assert _same(loaded, _snapshot(*saved))


class _BuildsNothing:
    @overlapkit.hookimpl
    def overlapkit_register_load_planners(self) -> list[overlapkit.LoadPlannerRecord]:
        return [overlapkit.LoadPlannerRecord(name="nothing", build=lambda **options: None)]


def test_a_planner_builder_returning_no_planner_is_refused_naming_it(
        overlapkit_plugin_manager: Any, tmp_path: Path) -> None:
    # f2b92e2: planner=None reached dcp.load, which loaded with DCP's own default planner
    # (the one that unpickles arbitrary objects), silently
    overlapkit_plugin_manager.register(_BuildsNothing(), name="no-planner")
    checkpoint.save(tmp_path / "ck", *_make(0))
    model, opt = _make(1)
    before = _snapshot(model, opt)
    with pytest.raises(overlapkit.ConfigurationError,
                       match="load planner 'nothing' returned a NoneType"):
        checkpoint.load(tmp_path / "ck", model, opt, planner="nothing")
    assert _same(_snapshot(model, opt), before)


class _Midway(SafeLoadPlanner):
    """Raises in its fourth ``resolve_tensor`` (three tensors read already), or in
    ``load_bytes`` (every tensor read already)."""

    def __init__(self, where: str, **options: Any) -> None:
        super().__init__(**options)
        self.where, self.calls = where, 0

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        self.calls += 1
        if self.where == "resolve_tensor" and self.calls == 4:
            raise ValueError("the planner's own bug")
        return super().resolve_tensor(read_item)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        if self.where == "load_bytes":
            raise ValueError("the planner's own bug")
        super().load_bytes(read_item, value)


class _Copies(SafeLoadPlanner):
    """Reads each tensor into a copy (a clone, or a float16 one) it never writes back."""

    def __init__(self, dtype: torch.dtype | None, **options: Any) -> None:
        super().__init__(**options)
        self.dtype = dtype

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        tensor = super().resolve_tensor(read_item)
        return tensor.clone() if self.dtype is None else tensor.to(self.dtype)


class _CopiesBack(_Copies):
    """Reads into a float16 copy and writes it back in ``commit_tensor``: allowed."""

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.lookup_tensor(read_item.dest_index).copy_(tensor)


class _Failing:
    @overlapkit.hookimpl
    def overlapkit_register_load_planners(self) -> list[overlapkit.LoadPlannerRecord]:
        def build(cls: Any, arg: Any) -> Any:
            return lambda **options: cls(arg, **{k: v for k, v in options.items()
                                                 if k != "fqn_to_offset"})
        return [overlapkit.LoadPlannerRecord(name=name, build=build(cls, arg))
                for name, cls, arg in (("resolve_raises", _Midway, "resolve_tensor"),
                                       ("bytes_raise", _Midway, "load_bytes"),
                                       ("clones", _Copies, None),
                                       ("halves", _Copies, torch.float16),
                                       ("halves_back", _CopiesBack, torch.float16))]


@pytest.mark.parametrize("name", ["resolve_raises", "bytes_raise"])
def test_a_planner_plugin_raising_midway_changes_nothing(
        overlapkit_plugin_manager: Any, tmp_path: Path, name: str) -> None:
    # be7423f: a checkpoint with its file list (every save's) was read straight into the
    # model: the tensors read before the planner raised were loaded (the model's first
    # three, or every tensor where load_bytes raised), the CheckpointError silent on it
    overlapkit_plugin_manager.register(_Failing(), name="failing-planners")
    checkpoint.save(tmp_path / "ck", *_make(0))
    model, opt = _make(1)
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match="the planner's own bug"):
        checkpoint.load(tmp_path / "ck", model, opt, planner=name)
    assert _same(_snapshot(model, opt), before)


@pytest.mark.parametrize("name", ["clones", "halves"])
def test_a_planner_plugin_reading_into_copies_it_drops_is_refused(
        overlapkit_plugin_manager: Any, tmp_path: Path, name: str) -> None:
    # be7423f: loaded with no error, the tensors keeping the values they had while the
    # optimizer's lr was loaded: neither the saved state nor the one before
    overlapkit_plugin_manager.register(_Failing(), name="failing-planners")
    checkpoint.save(tmp_path / "ck", *_make(0))
    model, opt = _make(1)
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError) as refused:
        checkpoint.load(tmp_path / "ck", model, opt, planner=name)
    message = str(refused.value)
    assert f"load planner {name!r}" in message and "'model.0.weight'" in message
    assert "resolve_tensor" in message and "Nothing was loaded" in message
    assert _same(_snapshot(model, opt), before)


def test_a_planner_plugin_writing_its_copies_back_loads(
        overlapkit_plugin_manager: Any, tmp_path: Path) -> None:
    overlapkit_plugin_manager.register(_Failing(), name="failing-planners")
    saved = _make(0)
    checkpoint.save(tmp_path / "ck", *saved)
    model, opt = _make(1)
    checkpoint.load(tmp_path / "ck", model, opt, planner="halves_back")
    loaded, expected = _snapshot(model, opt), _snapshot(*saved)
    assert loaded[-1] == expected[-1]
    for a, b in zip(loaded[:-1], expected[:-1], strict=True):  # through float16
        assert torch.equal(a, b.to(torch.float16).to(b.dtype)) or torch.equal(a, b)
