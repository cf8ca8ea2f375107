"""The registry: MRO resolution, names, conflicts and record validation."""

from __future__ import annotations

import types

import pytest
import torch

import overlapkit
from overlapkit.overlap.core.generic import GenericOverlapEngine
from overlapkit.plugin.manager import OverlapkitPluginManager


class GenericOverlap(GenericOverlapEngine):
    pass


class AdamOverlap(GenericOverlapEngine):
    pass


class MyAdam(torch.optim.Adam):
    pass


def _plugin(name: str, **hooks: object) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook, returned in hooks.items():
        def impl(returned: object = returned) -> object:
            return returned

        impl.__name__ = hook
        setattr(module, hook, overlapkit.hookimpl(impl))
    return module


def _manager(*plugins: types.ModuleType) -> OverlapkitPluginManager:
    pm = OverlapkitPluginManager()
    for plugin in plugins:
        pm.register(plugin, name=plugin.__name__)
    return pm


def _optimizers(*specs: tuple[type, type]) -> list[overlapkit.OptimizerRecord]:
    return [overlapkit.OptimizerRecord(optim_cls=o, overlapped_cls=c) for o, c in specs]


def test_most_specific_class_in_the_mro_wins() -> None:
    pm = _manager(
        _plugin("generic", overlapkit_register_optimizers=_optimizers(
            (torch.optim.Optimizer, GenericOverlap))),
        _plugin("adam", overlapkit_register_optimizers=_optimizers(
            (torch.optim.Adam, AdamOverlap))),
    )
    registry = pm.registry
    assert registry.optimizer_spec(MyAdam).overlapped_cls is AdamOverlap
    assert registry.optimizer_spec(torch.optim.Adam).overlapped_cls is AdamOverlap
    assert registry.optimizer_spec(torch.optim.SGD).overlapped_cls is GenericOverlap
    assert registry.optimizer_provider(torch.optim.Adam).plugin == "adam"


def test_two_plugins_claiming_one_optimizer_class_fail_naming_both() -> None:
    pm = _manager(
        _plugin("first", overlapkit_register_optimizers=_optimizers(
            (torch.optim.Adam, AdamOverlap))),
        _plugin("second", overlapkit_register_optimizers=_optimizers(
            (torch.optim.Adam, GenericOverlap))),
    )
    with pytest.raises(overlapkit.PluginConflictError, match="'first' and 'second'"):
        pm.registry  # noqa: B018


def test_optimizer_without_any_provider_is_unsupported() -> None:
    pm = _manager(_plugin("adam", overlapkit_register_optimizers=_optimizers(
        (torch.optim.Adam, AdamOverlap))))
    with pytest.raises(overlapkit.UnsupportedOptimizerError, match="SGD"):
        pm.registry.optimizer_spec(torch.optim.SGD)


def test_the_missing_provider_error_names_the_builtin_plugin_that_serves_every_optimizer(
        ) -> None:
    pm = overlapkit.create_plugin_manager(autoload=False, disabled=["overlapkit.overlap"])
    with pytest.raises(overlapkit.UnsupportedOptimizerError) as caught:
        pm.registry.optimizer_spec(torch.optim.SGD)
    named = [i.name for i in pm.plugin_infos() if f"'{i.name}'" in str(caught.value)]
    assert named == ["overlapkit.overlap"], str(caught.value)


@pytest.mark.parametrize(
    "not_an_optimizer", [torch.nn.Linear, torch.optim.SGD([torch.zeros(1)], lr=1), "adam"]
)
def test_resolving_a_non_optimizer_class_says_what_to_pass(not_an_optimizer: object) -> None:
    pm = _manager()
    with pytest.raises(overlapkit.UnsupportedOptimizerError, match="optimizer class itself"):
        pm.registry.optimizer_spec(not_an_optimizer)  # type: ignore[arg-type]


def test_unknown_name_lists_the_valid_names(
    overlapkit_plugin_manager: OverlapkitPluginManager,
) -> None:
    with pytest.raises(overlapkit.UnknownNameError) as caught:
        overlapkit.build_comm_hook("allreduse")
    assert isinstance(caught.value, LookupError)
    message = str(caught.value)
    assert "unknown comm hook 'allreduse'" in message
    assert "'allreduce', 'bf16_compress', 'fp16_compress'" in message


def test_names_are_normalised(overlapkit_plugin_manager: OverlapkitPluginManager) -> None:
    _, hook = overlapkit.build_comm_hook("FP16-Compress")
    assert hook.__name__ == "fp16_compress_hook"


def test_hook_returning_a_non_record_names_the_plugin() -> None:
    pm = _manager(_plugin("sloppy", overlapkit_register_averagers=["periodic"]))
    with pytest.raises(overlapkit.PluginValidationError, match=r"plugin 'sloppy'.*AveragerRecord"):
        pm.registry  # noqa: B018


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: overlapkit.CommHookRecord(name="2fast", build=print), ValueError, "lower-case"),
        (lambda: overlapkit.CommHookRecord(name="ok", build="print"), TypeError, "callable"),
        (lambda: overlapkit.OptimizerRecord(optim_cls=torch.nn.Linear, overlapped_cls=AdamOverlap),
         TypeError, "torch.optim.Optimizer"),
        (lambda: overlapkit.OptimizerRecord(optim_cls=torch.optim.Adam,
                                            overlapped_cls=object()),
         TypeError, "must be a subclass of overlapkit.plugin.OverlapEngine"),
        (lambda: overlapkit.OptimizerRecord(optim_cls=torch.optim.Adam, overlapped_cls=dict),
         TypeError, "must be a subclass of overlapkit.plugin.OverlapEngine"),
        (lambda: overlapkit.LoadPlannerRecord(name="x", build=print, detect=3),
         TypeError, "callable"),
    ],
)
def test_records_validate_their_fields(make: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make()  # type: ignore[operator]


def test_registering_a_plugin_refreshes_the_registry(
    overlapkit_plugin_manager: OverlapkitPluginManager,
) -> None:
    before = set(overlapkit_plugin_manager.registry.comm_hooks)
    overlapkit_plugin_manager.register(_plugin("extra", overlapkit_register_comm_hooks=[
        overlapkit.CommHookRecord(name="extra", build=lambda **kw: (None, None))]), name="extra")
    assert set(overlapkit_plugin_manager.registry.comm_hooks) == before | {"extra"}
    info = {i.name: i for i in overlapkit.list_plugins()}["extra"]
    assert (info.source, info.provides) == ("registered", {"comm_hooks": ["extra"]})


def test_two_plugins_with_one_name_conflict() -> None:
    pm = _manager(_plugin("same"))
    with pytest.raises(overlapkit.PluginConflictError, match="two plugins are named 'same'"):
        pm.register(_plugin("other"), name="same")


def test_blocked_builtin_is_listed_and_provides_nothing() -> None:
    pm = overlapkit.create_plugin_manager(autoload=False, disabled=["overlapkit.comm_hooks"])
    assert pm.registry.provided_by("overlapkit.comm_hooks") == {}
    assert "allreduce" not in pm.registry.comm_hooks
    statuses = {i.name: i.status for i in pm.plugin_infos()}
    assert statuses["overlapkit.comm_hooks"] == "blocked"


def test_comm_hook_rejects_unknown_options(
    overlapkit_plugin_manager: OverlapkitPluginManager,
) -> None:
    with pytest.raises(overlapkit.ConfigurationError, match="takes no options"):
        overlapkit.build_comm_hook("allreduce", bucket_cap=3)
