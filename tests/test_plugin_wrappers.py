"""Plugins using pluggy's hook wrappers (``wrapper=True``, ``hookwrapper=True``) around
overlapkit's own hook implementations: honoured as pluggy runs them, each record
attributed to the plugin that returned it (``overlapkit.plugin.wrappers``)."""

from __future__ import annotations

import types
from collections.abc import Generator
from typing import Any

import pytest
import torch
from torch import nn

import overlapkit
from overlapkit.comm_hooks import allreduce_hook
from overlapkit.errors import PluginConflictError, PluginValidationError
from overlapkit.plugin import CommHookRecord, hookimpl
from overlapkit.plugin.manager import create_plugin_manager, set_plugin_manager


def _build(*, process_group: Any = None, **options: Any) -> tuple[Any, Any]:
    return process_group, allreduce_hook


MINE = CommHookRecord(name="mine", build=_build, description="the wrapper's own")


def _manager(module: types.ModuleType) -> Any:
    pm = create_plugin_manager(autoload=False, disabled=(), trace=False)
    pm.register(module, name=module.__name__)
    pm.check_hooks()
    return pm


def _module(name: str, impl: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    impl.__name__ = "overlapkit_register_comm_hooks"
    module.overlapkit_register_comm_hooks = impl  # type: ignore[attr-defined]
    return module


def test_new_style_wrapper_adds_a_record_and_drops_one() -> None:
    def impl() -> Generator[None, list[Any], list[Any]]:
        results = yield
        kept = [[r for r in returned if r.name != "fp16_compress"]
                if isinstance(returned, list) else returned for returned in results]
        return [*kept, MINE]

    pm = _manager(_module("wrapping", hookimpl(wrapper=True)(impl)))
    hooks = pm.registry.comm_hooks
    assert "fp16_compress" not in hooks
    assert hooks["mine"].plugin == "wrapping"
    assert hooks["allreduce"].plugin == "overlapkit.comm_hooks"
    assert hooks["post_local_sgd"].plugin == "overlapkit.local_sgd"
    assert pm.registry.provided_by("wrapping") == {"comm_hooks": ["mine"]}


def test_new_style_wrapper_passing_through_changes_nothing() -> None:
    def impl() -> Generator[None, list[Any], list[Any]]:
        return (yield)

    pm = _manager(_module("passing", hookimpl(wrapper=True)(impl)))
    plain = create_plugin_manager(autoload=False, disabled=(), trace=False)
    assert ({n: p.plugin for n, p in pm.registry.comm_hooks.items()}
            == {n: p.plugin for n, p in plain.registry.comm_hooks.items()})
    assert pm.registry.provided_by("passing") == {}


def test_old_style_hookwrapper_forcing_a_result() -> None:
    def impl() -> Generator[None, Any, None]:
        outcome = yield
        outcome.force_result([*outcome.get_result(), [MINE]])

    pm = _manager(_module("old_style", hookimpl(hookwrapper=True)(impl)))
    assert pm.registry.comm_hooks["mine"].plugin == "old_style"
    assert pm.registry.comm_hooks["allreduce"].plugin == "overlapkit.comm_hooks"


def test_wrapper_replacing_a_builtin_record_is_used_by_overlap_ddp_name() -> None:
    """A wrapper putting its own record in place of a built-in one of the same name:
    the name resolves to the wrapper's record, no conflict."""
    calls: list[str] = []

    def build(*, process_group: Any = None, **options: Any) -> tuple[Any, Any]:
        calls.append("built")
        return process_group, allreduce_hook

    own = CommHookRecord(name="allreduce", build=build, description="counted")

    def impl() -> Generator[None, list[Any], list[Any]]:
        results = yield
        return [[own if r.name == "allreduce" else r for r in returned]
                if isinstance(returned, list) else returned for returned in results]

    pm = _manager(_module("replacing", hookimpl(wrapper=True)(impl)))
    assert pm.registry.comm_hooks["allreduce"].plugin == "replacing"
    previous = set_plugin_manager(pm)
    try:
        overlapkit.build_comm_hook("allreduce")
    finally:
        set_plugin_manager(previous)
    assert calls == ["built"]


@pytest.mark.parametrize("returned", [None, MINE, "x"])
def test_wrapper_returning_no_list_is_named(returned: Any) -> None:
    def impl() -> Generator[None, list[Any], Any]:
        yield
        return returned

    pm = _manager(_module("bad_wrapper", hookimpl(wrapper=True)(impl)))
    with pytest.raises(PluginValidationError, match=r"bad_wrapper.*wrapper returned"):
        pm.registry  # noqa: B018


def test_wrapper_raising_is_named() -> None:
    def impl() -> Generator[None, list[Any], list[Any]]:
        yield
        raise RuntimeError("boom")

    pm = _manager(_module("raising_wrapper", hookimpl(wrapper=True)(impl)))
    with pytest.raises(PluginValidationError, match=r"raising_wrapper.*wrapper raised "
                                                    "RuntimeError: boom"):
        pm.registry  # noqa: B018


def test_wrapper_duplicating_a_record_still_conflicts() -> None:
    def impl() -> Generator[None, list[Any], list[Any]]:
        results = yield
        return [*results, MINE, [MINE]]

    pm = _manager(_module("twice", hookimpl(wrapper=True)(impl)))
    with pytest.raises(PluginConflictError, match=r"twice.*'mine'"):
        pm.registry  # noqa: B018


def test_hookimpl_with_an_argument_says_the_hooks_take_none() -> None:
    def impl(config: Any) -> None:
        return None

    with pytest.raises(PluginValidationError, match="take no arguments"):
        _manager(_module("with_argument", hookimpl(impl)))


def test_wrapper_provided_comm_hook_trains_as_plain(run_distributed: Any) -> None:
    """overlap_ddp with comm_hook= a name a wrapper provides, on a 1-rank group: bitwise
    the plain DDP loop."""
    assert run_distributed(_train_rank, 1) == [True]


def _train_rank(rank: int, world_size: int) -> bool:
    from torch.nn.parallel import DistributedDataParallel as DDP

    def impl() -> Generator[None, list[Any], list[Any]]:
        return [*(yield), MINE]

    set_plugin_manager(_manager(_module("train_wrapper", hookimpl(wrapper=True)(impl))))

    def run(overlapped: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        ddp = DDP(model)
        opt: Any = torch.optim.Adam(ddp.parameters(), lr=0.01)
        if overlapped:
            opt = overlapkit.overlap_ddp(ddp, opt, comm_hook="mine")
        for step in range(3):
            ddp(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    return all(torch.equal(a, b) for a, b in zip(run(False), run(True), strict=True))
