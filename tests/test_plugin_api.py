"""The plugin author's API: one table of hook kinds, linear collection, any Sequence,
records that validate when built, one option check, and everything importable from
``overlapkit.plugin``."""

from __future__ import annotations

import ast
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import overlapkit
import overlapkit.plugin
from overlapkit.overlap.core.generic import GenericOverlapEngine
from overlapkit.plugin import hookspecs
from overlapkit.plugin.manager import OverlapkitPluginManager, create_plugin_manager
from overlapkit.plugin.registry import HOOK_KINDS, Registry

ROOT = Path(__file__).resolve().parents[1]


def _plugin(name: str, **hooks: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook, impl in hooks.items():
        impl.__name__ = hook
        setattr(module, hook, overlapkit.hookimpl(impl))
    return module


def _manager(*plugins: types.ModuleType) -> OverlapkitPluginManager:
    pm = OverlapkitPluginManager()
    for plugin in plugins:
        pm.register(plugin, name=plugin.__name__)
    return pm


def _averager(name: str) -> overlapkit.AveragerRecord:
    def build(*, period: int, warmup_steps: int = 0) -> tuple[int, int]:
        return period, warmup_steps

    return overlapkit.AveragerRecord(name=name, build=build)


def test_the_table_has_one_row_per_hook_specification() -> None:
    specs = sorted(n for n in dir(hookspecs) if n.startswith("overlapkit_register_"))
    assert sorted(kind.hook for kind in HOOK_KINDS) == specs
    registry = Registry()
    assert sorted(registry.tables) == sorted(kind.table for kind in HOOK_KINDS)


def test_each_hook_of_each_plugin_is_called_once() -> None:
    calls: list[str] = []

    def make(i: int) -> types.ModuleType:
        def impl() -> overlapkit.AveragerRecord:
            calls.append(f"p{i}")
            return _averager(f"avg{i}")

        return _plugin(f"p{i}", overlapkit_register_averagers=impl)

    pm = _manager(*(make(i) for i in range(30)))
    registry = pm.registry
    assert sorted(calls) == sorted(f"p{i}" for i in range(30))  # linear: 30 calls, not 30²
    assert registry.provided_by("p7") == {"averagers": ["avg7"]}


@pytest.mark.parametrize("container", [list, tuple, lambda items: _Records(items)])
def test_any_sequence_of_records_is_accepted(container: Any) -> None:
    records = container([_averager("one"), _averager("two")])
    pm = _manager(_plugin("seq", overlapkit_register_averagers=lambda: records))
    assert sorted(pm.registry.averagers) == ["one", "two"]


class _Records:
    """A Sequence that is neither list nor tuple."""

    def __init__(self, items: list[Any]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> Any:
        return self._items[index]


# Register as a virtual Sequence, like a user's own container type would be.
__import__("collections.abc").abc.Sequence.register(_Records)


def test_a_hook_that_raises_names_the_plugin_and_the_hook() -> None:
    def broken() -> None:
        raise RuntimeError("database unavailable")

    pm = _manager(_plugin("flaky", overlapkit_register_comm_hooks=broken))
    with pytest.raises(overlapkit.PluginValidationError) as caught:
        pm.registry  # noqa: B018
    message = str(caught.value)
    assert "'flaky'" in message and "overlapkit_register_comm_hooks" in message
    assert "RuntimeError: database unavailable" in message
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_malformed_record_built_in_a_hook_names_the_plugin() -> None:
    def bad() -> overlapkit.CommHookRecord:
        return overlapkit.CommHookRecord(name="Not A Name!", build=print)

    pm = _manager(_plugin("sloppy", overlapkit_register_comm_hooks=bad))
    with pytest.raises(overlapkit.PluginValidationError, match=r"'sloppy'.*lower-case"):
        pm.registry  # noqa: B018


def test_an_optimizer_record_needs_an_engine_subclass() -> None:
    with pytest.raises(TypeError, match=r"subclass of overlapkit\.plugin\.OverlapEngine"):
        overlapkit.OptimizerRecord(optim_cls=torch.optim.SGD, overlapped_cls=dict)

    class Mine(GenericOverlapEngine):
        pass

    record = overlapkit.OptimizerRecord(optim_cls=torch.optim.SGD, overlapped_cls=Mine)
    assert record.overlapped_cls is Mine


def test_a_conflict_with_a_builtin_never_suggests_blocking_the_builtin() -> None:
    def clash() -> overlapkit.CommHookRecord:
        return overlapkit.CommHookRecord(name="allreduce", build=lambda **_: (None, None))

    pm = create_plugin_manager(autoload=False, disabled=(), trace=False)
    pm.register(_plugin("mine", overlapkit_register_comm_hooks=clash), name="mine")
    with pytest.raises(overlapkit.PluginConflictError) as caught:
        pm.registry  # noqa: B018
    message = str(caught.value)
    assert "OVERLAPKIT_DISABLE_PLUGINS=mine" in message
    assert "OVERLAPKIT_DISABLE_PLUGINS=overlapkit." not in message


def test_create_checks_the_options_before_building() -> None:
    record = _averager("checked")
    assert record.create(period=4) == (4, 0)
    with pytest.raises(overlapkit.ConfigurationError, match=r"takes no options \['perod'\]"):
        record.create(perod=4)
    with pytest.raises(overlapkit.ConfigurationError, match=r"needs the options \['period'\]"):
        record.create(warmup_steps=1)


def test_every_builtin_build_goes_through_the_option_check() -> None:
    with pytest.raises(overlapkit.ConfigurationError, match="comm hook 'allreduce'"):
        overlapkit.build_comm_hook("allreduce", compression=True)
    with pytest.raises(overlapkit.ConfigurationError, match="averager 'periodic'"):
        overlapkit.create_averager("periodic", perod=2)


def test_everything_a_plugin_author_needs_is_in_overlapkit_plugin() -> None:
    for name in overlapkit.plugin.__all__:
        assert getattr(overlapkit.plugin, name) is not None, name


@pytest.mark.parametrize("package", ["overlapkit-lion", "overlapkit-diloco"])
def test_the_example_plugins_import_only_the_public_modules(package: str) -> None:
    public = {"overlapkit", "overlapkit.plugin", "overlapkit.testing", "overlapkit.distributed"}
    private = []
    for path in (ROOT / "plugins" / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            private += [f"{path.name}: {m}" for m in modules
                        if m.startswith("overlapkit.") and m not in public]
    assert private == []
