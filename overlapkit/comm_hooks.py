"""Build a registered DDP comm hook by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from overlapkit.plugins import get_plugin_manager

__all__ = ["build_comm_hook"]


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
    return spec.build(process_group=process_group, **options)
