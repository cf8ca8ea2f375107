"""DDP comm hooks by name: :func:`build_comm_hook`, and the built-in plugin
``overlapkit.comm_hooks`` that registers the standard ones.

``allreduce`` (DDP's default: average over the group), ``fp16_compress`` and
``bf16_compress`` (cast to half precision for the allreduce, cast back after). They wrap
torch's own hooks, so results match DDP with the same hook registered by hand. Other
packages register more (``post_local_sgd`` comes from :mod:`overlapkit.local_sgd`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from overlapkit.errors import ConfigurationError
from overlapkit.plugin.hookspecs import hookimpl
from overlapkit.plugin.manager import get_plugin_manager
from overlapkit.plugin.records import CommHookRecord

__all__ = ["build_comm_hook", "overlapkit_register_comm_hooks"]


def build_comm_hook(
    name: str, *, process_group: Any = None, **options: Any
) -> tuple[Any, Callable[..., Any]]:
    """Build the comm hook registered as ``name``: ``(state, hook)`` for
    ``DistributedDataParallel.register_comm_hook(state, hook)``.

    :param process_group: the group to communicate over (``None``: the default group).
    :param options: the hook's own options (``overlapkit plugins`` lists the hooks).
    :raises UnknownNameError: no plugin provides ``name``; the message lists the valid names.
    """
    spec = get_plugin_manager().registry.comm_hook(name)
    return spec.create(process_group=process_group, **options)


def _stateless(name: str, hook: Callable[..., Any]) -> Callable[..., tuple[Any, Any]]:
    def build(*, process_group: Any = None, **options: Any) -> tuple[Any, Any]:
        if options:
            raise ConfigurationError(
                f"comm hook {name!r} takes no options, got {sorted(options)}; "
                "remove them from comm_hook_options."
            )
        return process_group, hook

    build.__name__ = f"build_{name}"
    build.__doc__ = f"Build torch's ``{hook.__name__}`` as ``(process_group, hook)``."
    return build


@hookimpl
def overlapkit_register_comm_hooks() -> list[CommHookRecord]:
    return [
        CommHookRecord(
            name="allreduce",
            build=_stateless("allreduce", default_hooks.allreduce_hook),
            description="average gradients over the group (DDP's default)",
        ),
        CommHookRecord(
            name="fp16_compress",
            build=_stateless("fp16_compress", default_hooks.fp16_compress_hook),
            description="allreduce in float16, then cast back",
        ),
        CommHookRecord(
            name="bf16_compress",
            build=_stateless("bf16_compress", default_hooks.bf16_compress_hook),
            description="allreduce in bfloat16, then cast back",
        ),
    ]
