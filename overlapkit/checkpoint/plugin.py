"""Built-in plugin ``overlapkit.checkpoint``: the DCP load planners.

``default`` (DCP's default planner, restoring non-tensor entries without unpickling
arbitrary objects) and ``offset_2d`` (the legacy 2-D FSDP1 + TP layout of nested
``ShardedTensor`` s, detected from the model state dict). See
:mod:`overlapkit.checkpoint.planners`.
"""

from __future__ import annotations

from typing import Any

from overlapkit.plugin.hookspecs import hookimpl
from overlapkit.plugin.records import LoadPlannerRecord

__all__ = ["overlapkit_register_load_planners"]


def _build_default(**options: Any) -> Any:
    from overlapkit.checkpoint.planners import SafeLoadPlanner

    options.pop("fqn_to_offset", None)  # every offset is in the tensors themselves
    return SafeLoadPlanner(**options)


def _build_offset_2d(**options: Any) -> Any:
    from overlapkit.checkpoint.planners import OffsetLoadPlanner

    return OffsetLoadPlanner(**options)


def _detect_nested_sharded_tensor(state_dict: Any) -> bool:
    from overlapkit.checkpoint.planners import has_nested_sharded_tensor

    return has_nested_sharded_tensor(state_dict)


@hookimpl
def overlapkit_register_load_planners() -> list[LoadPlannerRecord]:
    return [
        LoadPlannerRecord(
            name="default",
            build=_build_default,
            description="DCP's default planner; any layout whose tensors know their "
            "offsets (plain, DTensor 1-D/2-D, ShardedTensor)",
        ),
        LoadPlannerRecord(
            name="offset_2d",
            build=_build_offset_2d,
            detect=_detect_nested_sharded_tensor,
            priority=10,
            description="reads tensor-parallel slices at their offset (legacy 2-D "
            "FSDP1+TP, nested ShardedTensor)",
        ),
    ]
