"""overlapkit: the optimizer side of PyTorch distributed training, as plugins.

Public API::

    import overlapkit
    overlapkit.list_plugins()                 # what is installed, and what it provides
    overlapkit.build_comm_hook("allreduce")   # a registered DDP comm hook, by name
    opt = overlapkit.overlap_ddp(ddp_model, torch.optim.AdamW, lr=1e-3)  # step per bucket
    @overlapkit.hookimpl                      # the marker for plugin hook functions

See ``docs/`` for the user guide and the plugin author guide.
"""

from __future__ import annotations

from typing import Any

from overlapkit.comm_hooks import build_comm_hook
from overlapkit.ddp_overlap import DDPOverlapOptimizer, overlap_ddp
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
from overlapkit.hookspecs import hookimpl
from overlapkit.overlapped import OverlappedOptimizer
from overlapkit.plugins import (
    PluginInfo,
    create_plugin_manager,
    get_plugin_manager,
    list_plugins,
    set_plugin_manager,
)
from overlapkit.records import AveragerSpec, CommHookSpec, LoadPlannerSpec, OptimizerSpec

__all__ = [
    "AveragerSpec",
    "CheckpointError",
    "CommHookSpec",
    "ConfigurationError",
    "DDPOverlapOptimizer",
    "LoadPlannerSpec",
    "OptimizerSpec",
    "OverlapkitError",
    "OverlappedOptimizer",
    "PluginConflictError",
    "PluginInfo",
    "PluginLoadError",
    "PluginValidationError",
    "UnknownNameError",
    "UnsupportedModelError",
    "UnsupportedOptimizerError",
    "__version__",
    "build_comm_hook",
    "create_plugin_manager",
    "get_plugin_manager",
    "hookimpl",
    "list_plugins",
    "overlap_ddp",
    "set_plugin_manager",
]


def __getattr__(name: str) -> Any:
    # __version__ is read from the installed metadata only when asked for.
    if name == "__version__":
        import importlib_metadata

        try:
            return importlib_metadata.version("overlapkit")
        except importlib_metadata.PackageNotFoundError:
            return "0+unknown"
    raise AttributeError(f"module 'overlapkit' has no attribute {name!r}")
