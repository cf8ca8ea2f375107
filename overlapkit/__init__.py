"""overlapkit: the optimizer side of PyTorch distributed training, as plugins.

Public API::

    import overlapkit
    overlapkit.list_plugins()                 # what is installed, and what it provides
    overlapkit.build_comm_hook("allreduce")   # a registered DDP comm hook, by name
    opt = overlapkit.overlap_ddp(ddp_model, torch.optim.AdamW, lr=1e-3)  # step per bucket
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-3)  # DDP/FSDP2/plain
    opt = overlapkit.post_local_sgd(ddp_model, torch.optim.SGD(params, lr=0.1),
                                    period=4, warmup_steps=100)   # post-local SGD
    @overlapkit.hookimpl                      # the marker for plugin hook functions
    overlapkit.checkpoint.save(path, model, optimizer)   # sharded, atomic checkpoints

See ``docs/`` for the user guide and the plugin author guide.

``import overlapkit`` imports neither torch nor any technique: each public name is
imported on first use (module ``__getattr__``), so ``overlapkit --help``, ``--version``
and the pytest plugin start in a fraction of a second instead of the 3 to 9 s
``import torch`` takes on a loaded 2-core machine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from overlapkit.errors import (
    CheckpointError,
    ConfigurationError,
    ExchangeFailedError,
    MissingDependencyError,
    NotPicklableError,
    OverlapkitError,
    PluginConflictError,
    PluginLoadError,
    PluginValidationError,
    RanksLostError,
    UnknownNameError,
    UnsupportedModelError,
    UnsupportedOptimizerError,
)
from overlapkit.plugin.hookspecs import hookimpl

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers
    from overlapkit import checkpoint
    from overlapkit.comm_hooks import build_comm_hook
    from overlapkit.local_sgd.optimizer import (
        PostLocalSGDOptimizer,
        create_averager,
        post_local_sgd,
    )
    from overlapkit.optimizer_wrapper import OptimizerWrapper
    from overlapkit.overlap.core.engine import OverlapEngine, OverlappedOptimizer
    from overlapkit.overlap.ddp.optimizer import DDPOverlapOptimizer
    from overlapkit.overlap.in_backward.optimizer import OptimizerInBackward
    from overlapkit.overlap.sharded import (
        ParamSlot,
        ShardedOverlapOptimizer,
        ShardingPolicy,
        SizeBalancedPolicy,
    )
    from overlapkit.overlap.techniques import optimizer_in_backward, overlap_ddp
    from overlapkit.plugin.manager import (
        PluginInfo,
        create_plugin_manager,
        get_plugin_manager,
        list_plugins,
        set_plugin_manager,
    )
    from overlapkit.plugin.records import (
        AveragerRecord,
        AveragerSpec,
        CommHookRecord,
        CommHookSpec,
        LoadPlannerRecord,
        LoadPlannerSpec,
        OptimizerRecord,
        OptimizerSpec,
    )

#: public name -> the module it is imported from on first use
_LAZY: dict[str, str] = {
    "build_comm_hook": "overlapkit.comm_hooks",
    "PostLocalSGDOptimizer": "overlapkit.local_sgd.optimizer",
    "create_averager": "overlapkit.local_sgd.optimizer",
    "post_local_sgd": "overlapkit.local_sgd.optimizer",
    "OptimizerWrapper": "overlapkit.optimizer_wrapper",
    "DDPOverlapOptimizer": "overlapkit.overlap.ddp.optimizer",
    "overlap_ddp": "overlapkit.overlap.techniques",
    "OverlapEngine": "overlapkit.overlap.core.engine",
    "OverlappedOptimizer": "overlapkit.overlap.core.engine",
    "OptimizerInBackward": "overlapkit.overlap.in_backward.optimizer",
    "optimizer_in_backward": "overlapkit.overlap.techniques",
    "ParamSlot": "overlapkit.overlap.sharded",
    "ShardedOverlapOptimizer": "overlapkit.overlap.sharded",
    "ShardingPolicy": "overlapkit.overlap.sharded",
    "SizeBalancedPolicy": "overlapkit.overlap.sharded",
    "PluginInfo": "overlapkit.plugin.manager",
    "create_plugin_manager": "overlapkit.plugin.manager",
    "get_plugin_manager": "overlapkit.plugin.manager",
    "list_plugins": "overlapkit.plugin.manager",
    "set_plugin_manager": "overlapkit.plugin.manager",
    "AveragerRecord": "overlapkit.plugin.records",
    "AveragerSpec": "overlapkit.plugin.records",
    "CommHookRecord": "overlapkit.plugin.records",
    "CommHookSpec": "overlapkit.plugin.records",
    "LoadPlannerRecord": "overlapkit.plugin.records",
    "LoadPlannerSpec": "overlapkit.plugin.records",
    "OptimizerRecord": "overlapkit.plugin.records",
    "OptimizerSpec": "overlapkit.plugin.records",
}

__all__ = [
    "OptimizerWrapper",
    "OverlappedOptimizer",
    "OptimizerSpec",
    "LoadPlannerSpec",
    "CommHookSpec",
    "AveragerSpec",
    "AveragerRecord",
    "CheckpointError",
    "CommHookRecord",
    "ConfigurationError",
    "DDPOverlapOptimizer",
    "ExchangeFailedError",
    "LoadPlannerRecord",
    "MissingDependencyError",
    "NotPicklableError",
    "OptimizerInBackward",
    "OptimizerRecord",
    "OverlapkitError",
    "ParamSlot",
    "OverlapEngine",
    "PluginConflictError",
    "PluginInfo",
    "PluginLoadError",
    "PluginValidationError",
    "PostLocalSGDOptimizer",
    "RanksLostError",
    "ShardedOverlapOptimizer",
    "ShardingPolicy",
    "SizeBalancedPolicy",
    "UnknownNameError",
    "UnsupportedModelError",
    "UnsupportedOptimizerError",
    "__version__",
    "build_comm_hook",
    "checkpoint",
    "create_averager",
    "create_plugin_manager",
    "get_plugin_manager",
    "hookimpl",
    "list_plugins",
    "optimizer_in_backward",
    "overlap_ddp",
    "post_local_sgd",
    "set_plugin_manager",
]


def __getattr__(name: str) -> Any:
    """Import a public name on first use, and keep it (later lookups are plain)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name == "checkpoint":  # imports torch.distributed.checkpoint
        value = importlib.import_module("overlapkit.checkpoint")
    elif name == "__version__":  # read from the installed metadata
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("overlapkit")
        except PackageNotFoundError:
            value = "0+unknown"
    else:
        raise AttributeError(f"module 'overlapkit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
