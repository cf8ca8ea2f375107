"""How ``load`` creates a fresh optimizer's state: from a step on meta-device twins.

The state tensors must come out exactly as the optimizer's own first step lays them
out (type, shape, dtype, strides, device, ``DTensor`` mesh and placements), for every
layout, without touching the parameters or their gradients; an optimizer whose step
cannot run on meta tensors falls back to a real step; a failed load leaves a fresh
optimizer without state. Exactness of the loaded values is covered by
``test_checkpoint_reshard.py``, which loads through this path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import checkpoint_ranks as scenarios
import pytest
import torch
from torch import nn

from overlapkit import checkpoint
from overlapkit.checkpoint import optimizer_state
from overlapkit.distributed import run_distributed
from overlapkit.errors import CheckpointError

LAYOUTS = ("plain", "ddp", "fsdp2", "fsdp1", "fsdp2_tp", "fsdp1_tp", "overlap_ddp")


def _build(kind: str) -> tuple[nn.Module, Any]:
    if kind != "overlap_ddp":
        return scenarios.build(kind)
    import overlapkit

    model, _ = scenarios.build("ddp")
    return model, overlapkit.overlap_ddp(model, torch.optim.AdamW, lr=0.01,
                                         weight_decay=0.1)


def _layout(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, torch.Tensor):
        return ("value", value)
    described: tuple[Any, ...] = (type(value).__name__, tuple(value.shape), value.dtype,
                                  value.stride(), value.device.type)
    if hasattr(value, "placements"):
        local = value.to_local()
        described += (str(value.placements), value.device_mesh.mesh.tolist(),
                      tuple(local.shape), local.stride(), local.device.type)
    return described


def _state_layouts(state: Any, order: list[torch.Tensor]) -> list[Any]:
    return [sorted((key, _layout(value)) for key, value in state[p].items())
            for p in order if p in state]


def _layouts_on_ranks(rank: int, ws: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in LAYOUTS:
        _model, opt = _build(kind)
        params = [p for group in opt.param_groups for p in group["params"]]
        before = [p.detach().clone() for p in params]
        lists = [group["params"] for group in opt.param_groups]
        meta_state = optimizer_state._state_from_meta_step(opt)
        ok = meta_state is not None
        untouched = (all(torch.equal(p.detach(), b) for p, b in zip(params, before,
                                                                      strict=True))
                     and all(p.grad is None for p in params) and not opt.state
                     and all(group["params"] is kept for group, kept
                             in zip(opt.param_groups, lists, strict=True)))
        created = optimizer_state.allocate_optimizer_state(opt)
        _real_model, real_opt = _build(kind)
        optimizer_state.init_optimizer_state(real_opt)
        real_params = [p for group in real_opt.param_groups for p in group["params"]]
        out[kind] = {
            "meta_step_ran": ok,
            "untouched": untouched,
            "created": bool(created),
            "meta": _state_layouts(opt.state, params),
            "real": _state_layouts(real_opt.state, real_params),
            "steps": sorted(float(opt.state[p]["step"]) for p in params if p in opt.state),
        }
    return out


@pytest.fixture(scope="module")
def layouts() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_layouts_on_ranks, 2)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_meta_step_gives_the_optimizers_own_state_layout(
    layouts: list[dict[str, dict[str, Any]]], kind: str
) -> None:
    for rank in layouts:
        got = rank[kind]
        assert got["meta_step_ran"], kind  # not the real-step fallback
        assert got["created"]
        assert got["meta"] and got["meta"] == got["real"]


@pytest.mark.parametrize("kind", LAYOUTS)
def test_meta_step_leaves_parameters_gradients_and_groups_alone(
    layouts: list[dict[str, dict[str, Any]]], kind: str
) -> None:
    for rank in layouts:
        assert rank[kind]["untouched"], kind
        assert set(rank[kind]["steps"]) == {1.0}  # the step ran once, with lr 0


class _CountingSGD(torch.optim.Optimizer):
    """Keeps a Python int computed with ``.item()``: its step cannot run on meta."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("buf", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                state["nonzero"] = state.get("nonzero", 0) + int(buf.count_nonzero().item())
                p.add_(buf, alpha=-group["lr"])


def _trained(optim_cls: type, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = optim_cls(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(3, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_optimizer_that_cannot_step_on_meta_falls_back_and_loads_exactly(
    tmp_path: Path,
) -> None:
    model, opt = _trained(_CountingSGD, seed=0)
    checkpoint.save(tmp_path / "ckpt", model, opt)
    fresh_model, fresh_opt = _trained(_CountingSGD, seed=1)
    fresh_opt.state.clear()
    with pytest.raises((RuntimeError, NotImplementedError)):  # .item() on meta
        optimizer_state._state_from_meta_step(fresh_opt)
    assert not fresh_opt.state and all(p.grad is None for p in fresh_model.parameters())
    checkpoint.load(tmp_path / "ckpt", fresh_model, fresh_opt)
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["buf"], fresh_opt.state[q]["buf"])
        assert opt.state[p]["nonzero"] == fresh_opt.state[q]["nonzero"]


@pytest.mark.parametrize("damage", ["shape", "data file"])
def test_a_failed_load_leaves_a_fresh_optimizer_without_state(
    tmp_path: Path, damage: str
) -> None:
    model, opt = _trained(torch.optim.AdamW, seed=0)
    path = checkpoint.save(tmp_path / "ckpt", model, opt)
    if damage == "shape":
        target = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    else:
        target = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        for data in path.glob("*.distcp"):
            data.write_bytes(data.read_bytes()[:100])
    fresh = torch.optim.AdamW(target.parameters(), lr=0.1)
    with pytest.raises(CheckpointError):
        checkpoint.load(path, target, fresh)
    assert not fresh.state


def test_loading_into_an_optimizer_with_state_keeps_its_tensors(tmp_path: Path) -> None:
    model, opt = _trained(torch.optim.AdamW, seed=0)
    path = checkpoint.save(tmp_path / "ckpt", model, opt)
    target, target_opt = _trained(torch.optim.AdamW, seed=1)
    live = {id(target_opt.state[p]["exp_avg"]) for p in target.parameters()}
    checkpoint.load(path, target, target_opt)
    assert {id(target_opt.state[p]["exp_avg"]) for p in target.parameters()} == live
    for p, q in zip(model.parameters(), target.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], target_opt.state[q]["exp_avg"])


def _count_direct_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    from overlapkit.checkpoint import reading

    counts = {"direct": 0, "dcp": 0}
    read_into = reading.read_into

    def counted(*args: Any) -> bool:
        done = read_into(*args)
        counts["direct" if done else "dcp"] += 1
        return done

    monkeypatch.setattr(reading, "read_into", counted)
    return counts


def test_tensors_are_read_straight_into_their_destination(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _trained(torch.optim.AdamW, seed=0)
    path = checkpoint.save(tmp_path / "ckpt", model, opt)
    counts = _count_direct_reads(monkeypatch)
    target, target_opt = _trained(torch.optim.AdamW, seed=1)
    checkpoint.load(path, target, target_opt)
    assert counts == {"direct": 4 + 4 * 3, "dcp": 0}  # parameters; step, exp_avg(_sq)
    for p, q in zip(model.parameters(), target.parameters(), strict=True):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(value, target_opt.state[q][key]), key


def test_a_different_dtype_takes_dcps_path_and_converts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _trained(torch.optim.AdamW, seed=0)
    path = checkpoint.save(tmp_path / "ckpt", model, opt)
    counts = _count_direct_reads(monkeypatch)
    target = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    checkpoint.load(path, target)
    assert counts["direct"] == 0 and counts["dcp"] == 4
    for p, q in zip(model.parameters(), target.parameters(), strict=True):
        assert torch.equal(p.double(), q)
