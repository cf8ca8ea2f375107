"""A deliberately broken overlapped-optimizer plugin, for the conformance checks: its
bucket step is ``...`` (the walkthrough bug). Importing this module registers it with
the process's plugin manager, so spawned ranks that unpickle ``NoOpSGD`` get it too."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch

import overlapkit
from overlapkit.plugin import OptimizerRecord, OverlapEngine, ParamGroup
from overlapkit.plugin.manager import get_plugin_manager


class NoOpSGD(torch.optim.SGD):
    """SGD, served by the broken engine below."""


class NoOpEngine(OverlapEngine):
    def step_groups(self, groups: Sequence[tuple[ParamGroup, list[torch.Tensor]]]) -> None:
        ...  # the bug: nothing is stepped


@overlapkit.hookimpl
def overlapkit_register_optimizers() -> OptimizerRecord:
    return OptimizerRecord(optim_cls=NoOpSGD, overlapped_cls=NoOpEngine)


_pm = get_plugin_manager()
if not _pm.has_plugin("noop-test"):
    _pm.register(SimpleNamespace(overlapkit_register_optimizers=overlapkit_register_optimizers),
                 name="noop-test")
