"""A plugin hook that yields its records (a generator function not marked as a pluggy
wrapper) or returns them in a set: at ``4b7a286`` refused with "returned <generator
object ...>, expected CommHookRecord records ... return
overlapkit.plugin.CommHookRecord(...) instead", which is what the plugin did. Any
iterable of records is taken now (``overlapkit/plugin/registry.py``); a generator
raising part-way is named as a hook raising, and a mapping is still refused."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import overlapkit
from overlapkit.plugin.manager import OverlapkitPluginManager


def _build(*, process_group: Any = None) -> tuple[Any, Any]:
    from overlapkit.comm_hooks import allreduce_hook

    return process_group, allreduce_hook


def _record(name: str) -> overlapkit.CommHookRecord:
    return overlapkit.CommHookRecord(name=name, build=_build)


def _manager(name: str, impl: Any) -> OverlapkitPluginManager:
    module = types.ModuleType(name)
    impl.__name__ = "overlapkit_register_comm_hooks"
    module.overlapkit_register_comm_hooks = overlapkit.hookimpl(impl)  # type: ignore[attr-defined]
    pm = OverlapkitPluginManager()
    pm.register(module, name=name)
    return pm


def test_a_generator_function_hook_registers_what_it_yields() -> None:
    def hooks() -> Iterator[overlapkit.CommHookRecord]:
        yield _record("gen_one")
        yield _record("gen_two")

    registry = _manager("yielding", hooks).registry
    assert registry.provided_by("yielding") == {"comm_hooks": ["gen_one", "gen_two"]}
    _state, hook = registry.comm_hook("gen_two").create(process_group=None)
    assert hook.__name__ == "allreduce_hook"


def test_a_set_of_records_is_taken() -> None:
    records = {_record("set_one"), _record("set_two")}
    registry = _manager("setty", lambda: records).registry
    assert sorted(registry.provided_by("setty")["comm_hooks"]) == ["set_one", "set_two"]


def test_a_generator_raising_part_way_is_named_as_the_hook_raising() -> None:
    def hooks() -> Iterator[overlapkit.CommHookRecord]:
        yield _record("first")
        raise RuntimeError("config file missing")

    with pytest.raises(overlapkit.PluginValidationError) as caught:
        _manager("halfway", hooks).registry  # noqa: B018
    message = str(caught.value)
    assert "'halfway'" in message and "overlapkit_register_comm_hooks" in message
    assert "RuntimeError: config file missing" in message
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_mapping_of_records_is_refused_naming_what_to_return() -> None:
    records = {"one": _record("map_one")}
    with pytest.raises(overlapkit.PluginValidationError,
                       match=r"'mapping'.*returned a dict.*list of the records"):
        _manager("mapping", lambda: records).registry  # noqa: B018


def test_a_yielded_hook_trains_as_the_built_in_one(
        overlapkit_plugin_manager: Any, tmp_path: Any) -> None:
    """By name through ``overlap_ddp``, 1 gloo rank: bitwise plain DDP."""
    def hooks() -> Iterator[overlapkit.CommHookRecord]:
        yield _record("yielded_allreduce")

    module = types.ModuleType("yielder")
    hooks.__name__ = "overlapkit_register_comm_hooks"
    module.overlapkit_register_comm_hooks = overlapkit.hookimpl(hooks)  # type: ignore[attr-defined]
    overlapkit_plugin_manager.register(module, name="yielder")
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        results = []
        for technique in (None, "overlap_ddp"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            ddp = nn.parallel.DistributedDataParallel(model)
            opt: Any = torch.optim.Adam(ddp.parameters(), lr=0.01)
            if technique is not None:
                opt = overlapkit.overlap_ddp(ddp, opt, comm_hook="yielded_allreduce")
            for step in range(3):
                batch = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
                ddp(batch).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
            results.append([p.detach().clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    finally:
        torch.distributed.destroy_process_group()
