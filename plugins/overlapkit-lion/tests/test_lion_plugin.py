"""The plugin as users meet it: installed, listed, resolvable, blockable."""

from __future__ import annotations

import torch

import overlapkit
import overlapkit_lion.plugin
from overlapkit.plugin import OverlapkitPluginManager
from overlapkit.testing import installed_plugins
from overlapkit_lion import Lion, LionOverlapped


def test_installed_plugin_is_listed_with_its_version() -> None:
    listed = installed_plugins()["lion"]
    assert (listed["distribution"], listed["version"]) == ("overlapkit-lion", "0.1.0")
    assert listed["provides"] == {"optimizers": ["overlapkit_lion.optimizer.Lion"]}


def test_blocking_the_plugin_by_name_removes_it() -> None:
    listed = installed_plugins(OVERLAPKIT_DISABLE_PLUGINS="lion")
    assert listed["lion"]["status"] == "blocked"


def test_lion_and_its_subclasses_resolve_to_the_plugin(
    overlapkit_plugin_manager: OverlapkitPluginManager,
) -> None:
    overlapkit_plugin_manager.register(overlapkit_lion.plugin, name="lion")

    class MyLion(Lion):
        pass

    registry = overlapkit_plugin_manager.registry
    assert registry.optimizer_spec(MyLion).overlapped_cls is LionOverlapped
    assert registry.optimizer_spec(torch.optim.AdamW).overlapped_cls is not LionOverlapped


def test_lion_overlapped_refuses_other_optimizers() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    try:
        LionOverlapped(optimizer)
    except overlapkit.UnsupportedOptimizerError as exc:
        assert "Lion optimizers only" in str(exc)
    else:
        raise AssertionError("LionOverlapped accepted SGD")
