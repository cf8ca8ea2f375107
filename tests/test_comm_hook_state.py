"""A stateful comm hook chosen by name, ``overlap_ddp(..., comm_hook="powerSGD")`` from
a plugin's ``overlapkit_register_comm_hooks``, resumed, on 2 gloo ranks.

968cf42: nothing of the hook's state reached ``optimizer.state_dict()`` (overlapkit
builds the hook, so the user holds no ``PowerSGDState`` to save as torch documents):
the resumed run started PowerSGD afresh (warm-up counter, error feedback, warm-start
matrices, random generator), 0.08 off the uninterrupted run after 8 steps, silently.
Now ``state_dict()`` holds it under ``"comm_hook"`` (readable with
``weights_only=True``; a plain optimizer ignores it) and ``load_state_dict()`` puts it
back: bitwise the uninterrupted run. ``overlapkit.checkpoint.save`` warns that it does
not hold it; other PowerSGD settings at load are refused, nothing loaded.
"""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.distributed import run_distributed
from overlapkit.plugin.manager import get_plugin_manager

OPTIONS = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2,
           "min_compression_rate": 0.5}


class _Counted:
    """A plugin hook's state with ``state_dict()``: a count of the buckets reduced."""

    def __init__(self) -> None:
        self.buckets = 0

    def state_dict(self) -> dict[str, Any]:
        return {"buckets": self.buckets}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buckets = state["buckets"]


def _counted_hook(state, bucket):  # type: ignore[no-untyped-def]
    state.buckets += 1
    return powersgd.default.allreduce_hook(None, bucket)


@overlapkit.hookimpl
def overlapkit_register_comm_hooks() -> list[overlapkit.CommHookRecord]:
    def power(*, process_group: Any = None, **options: Any) -> Any:
        return powersgd.PowerSGDState(process_group=process_group, **options), \
            powersgd.powerSGD_hook
    return [overlapkit.CommHookRecord(name="powerSGD", build=power),
            overlapkit.CommHookRecord(
                name="counted", build=lambda *, process_group=None: (_Counted(), _counted_hook)),
            overlapkit.CommHookRecord(
                name="opaque", build=lambda *, process_group=None: (
                    SimpleNamespace(n=0), lambda s, b: powersgd.default.allreduce_hook(None, b)))]


def _model() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 4)), bucket_cap_mb=0.001)


def _ours(hook: str = "powerSGD", technique: str = "overlap_ddp",
          **options: Any) -> tuple[DDP, torch.optim.Optimizer]:
    model = _model()
    return model, getattr(overlapkit, technique)(
        model, torch.optim.SGD, lr=0.1, momentum=0.9, comm_hook=hook,
        comm_hook_options=(options or OPTIONS) if hook == "powerSGD" else None)


def _steps(model: DDP, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _halfway(build: Any) -> tuple[torch.Tensor, DDP, torch.optim.Optimizer]:
    """The plugin registered; the parameters after 8 steps of a run built by ``build``,
    and another such run after 4 steps, to be saved and resumed."""
    get_plugin_manager().register(SimpleNamespace(
        overlapkit_register_comm_hooks=overlapkit_register_comm_hooks), name="stateful")
    model, opt = build()
    _steps(model, opt, range(8))
    uninterrupted = _flat(model)
    model, opt = build()
    _steps(model, opt, range(4))
    return uninterrupted, model, opt


def _run(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    uninterrupted, model, opt = _halfway(_ours)
    checkpoint, saved = os.path.join(directory, "ck"), os.path.join(directory, f"o{rank}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        overlapkit.checkpoint.save(checkpoint, model, opt)
    out["save warned"] = [str(w.message) for w in caught]
    torch.save(opt.state_dict(), saved)
    state_dict = torch.load(saved, weights_only=True)
    out["keys"] = sorted(state_dict)
    plain = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    plain.load_state_dict(state_dict)  # a plain optimizer ignores the hook's entry
    for resume_hook in (True, False):
        model, opt = _ours()
        overlapkit.checkpoint.load(checkpoint, model, opt)
        if resume_hook:
            opt.load_state_dict(torch.load(saved, weights_only=True))
        _steps(model, opt, range(4, 8))
        out[f"bitwise {resume_hook}"] = torch.equal(_flat(model), uninterrupted)
    model, opt = _ours(technique="optimizer_in_backward")  # on DDP: the same hooks
    _steps(model, opt, range(8))
    uninterrupted = _flat(model)
    model, opt = _ours(technique="optimizer_in_backward")
    _steps(model, opt, range(4))
    overlapkit.checkpoint.save(checkpoint + "-ib", model, opt)
    torch.save(opt.state_dict(), saved + "-ib")
    model, opt = _ours(technique="optimizer_in_backward")
    overlapkit.checkpoint.load(checkpoint + "-ib", model, opt)
    opt.load_state_dict(torch.load(saved + "-ib", weights_only=True))
    _steps(model, opt, range(4, 8))
    out["bitwise in backward"] = torch.equal(_flat(model), uninterrupted)
    model, opt = _ours(**{**OPTIONS, "matrix_approximation_rank": 2})
    before = (opt.comm_hook_state.iter, opt.state_dict()["state"])
    try:
        opt.load_state_dict(torch.load(saved, weights_only=True))
        out["other settings"] = "loaded"
    except overlapkit.CheckpointError as refused:
        out["other settings"] = str(refused)
    out["nothing loaded"] = before == (opt.comm_hook_state.iter, opt.state_dict()["state"])
    model, opt = _ours()
    malformed = torch.load(saved, weights_only=True)
    del malformed["comm_hook"]["rng"]
    try:
        opt.load_state_dict(malformed)
        out["malformed"] = "loaded"
    except overlapkit.CheckpointError as refused:
        out["malformed"] = str(refused)
    model, opt = _ours("counted")
    _steps(model, opt, range(2))
    counted = opt.state_dict()
    model, opt = _ours("counted")
    opt.load_state_dict(counted)
    out["counted"] = (counted.get("comm_hook"), opt.comm_hook_state.buckets)
    model, opt = _ours("opaque")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.state_dict()
        opt.state_dict()
    out["opaque warned"] = [str(w.message) for w in caught]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("hook-state"))
    return run_distributed(_run, 2, args=(directory,), timeout=180)


def test_powersgd_state_resumes_bitwise_from_state_dict(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["keys"] == ["comm_hook", "param_groups", "state"]
        assert result["bitwise True"] is True
        assert result["bitwise False"] is False  # the checkpoint alone: hook afresh
        assert result["bitwise in backward"] is True  # optimizer_in_backward on DDP


def test_checkpoint_save_warns_that_it_does_not_hold_the_hook_state(
        results: list[dict[str, Any]]) -> None:
    for result in results:
        (warning,) = result["save warned"]
        assert "does not hold the state of the comm hook 'powersgd'" in warning


def test_other_powersgd_settings_are_refused_nothing_loaded(
        results: list[dict[str, Any]]) -> None:
    for result in results:
        assert "matrix_approximation_rank 1 saved, 2 now" in result["other settings"]
        assert result["nothing loaded"] is True
        assert "saved PowerSGD state is malformed (KeyError: 'rng')" in result["malformed"]


def test_a_plugin_state_with_state_dict_is_saved_and_an_opaque_one_warned_once(
        results: list[dict[str, Any]]) -> None:
    for result in results:
        saved, loaded = result["counted"]
        assert saved is not None and saved["buckets"] > 0 and loaded == saved["buckets"]
        (warning,) = result["opaque warned"]
        assert "does not hold the state of the comm hook 'opaque'" in warning


def _sharded(hook: str = "powerSGD") -> tuple[DDP, torch.optim.Optimizer]:
    model = _model()
    return model, overlapkit.overlap_ddp(
        model, torch.optim.SGD, lr=0.1, momentum=0.9, comm_hook=hook,
        comm_hook_options=OPTIONS if hook == "powerSGD" else None,
        shard_optimizer_state=True)


def _run_sharded(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    uninterrupted, model, opt = _halfway(_sharded)
    checkpoint, local = os.path.join(directory, "sk"), os.path.join(directory, f"s{rank}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        overlapkit.checkpoint.save(checkpoint, model, opt)
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            opt.state_dict()
            opt.state_dict()
    out["warned"] = [str(w.message) for w in caught]
    torch.save(opt.local_state_dict(), local)
    out["keys"] = sorted(torch.load(local, weights_only=True))
    for resume_hook in (True, False):
        model, opt = _sharded()
        overlapkit.checkpoint.load(checkpoint, model, opt)
        saved = torch.load(local, weights_only=True)
        if not resume_hook:
            del saved["comm_hook"]
        opt.load_state_dict(saved)
        _steps(model, opt, range(4, 8))
        out[f"bitwise {resume_hook}"] = torch.equal(_flat(model), uninterrupted)
    model, opt = _sharded()
    other = torch.load(local, weights_only=True)
    other["comm_hook"]["matrix_approximation_rank"] = 2
    try:
        opt.load_state_dict(other)
        out["other settings"] = "loaded"
    except overlapkit.CheckpointError as refused:
        out["other settings"] = str(refused)
    out["nothing loaded"] = opt.comm_hook_state.iter == 0 and len(opt.state) == 0
    return out


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("hook-state-sharded"))
    return run_distributed(_run_sharded, 2, args=(directory,), timeout=180)


def test_sharded_powersgd_state_resumes_bitwise_from_local_state_dict(
        sharded_results: list[dict[str, Any]]) -> None:
    """258114a: the sharded optimizer's state dicts held nothing of the hook's state,
    and the resumed run started PowerSGD afresh, silently."""
    for result in sharded_results:
        assert "comm_hook" in result["keys"]
        assert result["bitwise True"] is True
        assert result["bitwise False"] is False  # without the entry: the hook afresh


def test_sharded_whole_state_dict_and_checkpoint_warn_once_of_the_hook_state(
        sharded_results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(sharded_results):
        saved = [w for w in result["warned"] if "overlapkit.checkpoint.save()" in w]
        gathered = [w for w in result["warned"] if "optimizer.state_dict() (gathered)" in w]
        assert len(saved) == 1 and "local_state_dict()" in saved[0]
        assert len(gathered) == (1 if rank == 0 else 0)


def test_sharded_other_powersgd_settings_are_refused_nothing_loaded(
        sharded_results: list[dict[str, Any]]) -> None:
    for result in sharded_results:
        assert "matrix_approximation_rank 2 saved, 1 now" in result["other settings"]
        assert result["nothing loaded"] is True
