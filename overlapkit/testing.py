"""pytest fixtures for plugin authors (and overlapkit's own tests).

Installed as a pytest plugin through the ``pytest11`` entry point, so these fixtures
are available in any project that has overlapkit installed:

``overlapkit_plugin_manager``
    A fresh plugin manager with the built-in plugins and entry-point autoload off,
    installed as the process-wide manager for the duration of the test. Register the
    plugin under test on it::

        def test_my_averager(overlapkit_plugin_manager):
            overlapkit_plugin_manager.register(my_plugin, name="my-plugin")
            averager = overlapkit.create_averager("mine")

``run_distributed``
    :func:`overlapkit.distributed.run_distributed`: run a module-level function on
    several local gloo ranks and get each rank's result.

And :func:`installed_plugins`, for the test that a plugin package is installed and
listed (``overlapkit plugins --json`` in a fresh interpreter), and the conformance
checks of :mod:`overlapkit.plugin.conformance` — :func:`check_overlapped_optimizer`,
:func:`check_averager`, :func:`check_comm_hook` — that a plugin's own test calls.

Importing this module is light (no torch): pytest loads it at start-up wherever
overlapkit is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from overlapkit.plugin.conformance import (
        ConformanceError,
        check_averager,
        check_comm_hook,
        check_overlapped_optimizer,
    )
    from overlapkit.plugin.manager import OverlapkitPluginManager

__all__ = ["ConformanceError", "check_averager", "check_comm_hook",
           "check_overlapped_optimizer", "installed_plugins", "overlapkit_plugin_manager",
           "run_distributed"]

#: the conformance checks, imported on first use (they import torch); this module is
#: loaded by pytest at start-up in every project that has overlapkit installed, so it
#: imports nothing heavy itself
_CONFORMANCE = ("ConformanceError", "check_averager", "check_comm_hook",
                "check_overlapped_optimizer")


def __getattr__(name: str) -> object:
    if name in _CONFORMANCE:
        from overlapkit.plugin import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module 'overlapkit.testing' has no attribute {name!r}")


@pytest.fixture
def overlapkit_plugin_manager() -> Iterator[OverlapkitPluginManager]:
    """A fresh plugin manager (built-ins only, autoload off) used by overlapkit for
    the duration of the test; the previous one is restored afterwards."""
    from overlapkit.plugin.manager import create_plugin_manager, set_plugin_manager

    pm = create_plugin_manager(autoload=False, disabled=(), trace=False)
    previous = set_plugin_manager(pm)
    try:
        yield pm
    finally:
        set_plugin_manager(previous)


@pytest.fixture
def run_distributed() -> Callable[..., list[Any]]:
    """:func:`overlapkit.distributed.run_distributed`, as a fixture."""
    from overlapkit.distributed import run_distributed as run

    return run


def installed_plugins(**env: str) -> dict[str, dict[str, Any]]:
    """What ``overlapkit plugins --json`` lists, by plugin name, run in a fresh
    interpreter with ``env`` added to the environment (e.g.
    ``OVERLAPKIT_DISABLE_PLUGINS="lion"``): the path a user's installation takes."""
    proc = subprocess.run(
        [sys.executable, "-m", "overlapkit", "plugins", "--json"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )
    if proc.returncode != 0:
        raise AssertionError(f"overlapkit plugins --json failed:\n{proc.stderr}")
    return {plugin["name"]: plugin for plugin in json.loads(proc.stdout)}
