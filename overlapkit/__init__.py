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
"""

from __future__ import annotations

from typing import Any

from overlapkit.comm_hooks import build_comm_hook
from overlapkit.errors import (
    CheckpointError,
    ConfigurationError,
    OverlapkitError,
    PluginConflictError,
    PluginLoadError,
    PluginValidationError,
    UnknownNameError,
    UnsupportedModelError,
    UnsupportedOptimizerError,
)
from overlapkit.local_sgd.optimizer import PostLocalSGDOptimizer, create_averager, post_local_sgd
from overlapkit.optimizer_wrapper import OptimizerWrapper
from overlapkit.overlap.ddp import DDPOverlapOptimizer, overlap_ddp
from overlapkit.overlap.engine import OverlapEngine, OverlappedOptimizer
from overlapkit.overlap.in_backward import OptimizerInBackward, optimizer_in_backward
from overlapkit.plugin.hookspecs import hookimpl
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
    "LoadPlannerRecord",
    "OptimizerInBackward",
    "OptimizerRecord",
    "OverlapkitError",
    "OverlapEngine",
    "PluginConflictError",
    "PluginInfo",
    "PluginLoadError",
    "PluginValidationError",
    "PostLocalSGDOptimizer",
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
    # overlapkit.checkpoint imports torch.distributed.checkpoint: only when first used.
    if name == "checkpoint":
        import importlib

        return importlib.import_module("overlapkit.checkpoint")
    # __version__ is read from the installed metadata only when asked for.
    if name == "__version__":
        import importlib_metadata

        try:
            return importlib_metadata.version("overlapkit")
        except importlib_metadata.PackageNotFoundError:
            return "0+unknown"
    raise AttributeError(f"module 'overlapkit' has no attribute {name!r}")
