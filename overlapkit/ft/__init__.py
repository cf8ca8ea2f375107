"""Fault tolerance without restart, on torchft (``pip install 'overlapkit[ft]'``).

torchft (PyTorch's per-step fault-tolerance library) is the engine: a Lighthouse
forms a quorum of replica groups, a ``Manager`` per replica group reconfigures the
process group over the quorum and recovers a restarted group live from a peer.
overlapkit adds its averagers on top:

- :mod:`~overlapkit.ft.optimizer`: :func:`local_sgd`, post-local SGD and DiLoCo over
  the quorum (:class:`FaultTolerantLocalSGD`);
- :mod:`~overlapkit.ft.replicas`: :class:`ManagedReplicas`, the quorum as an averaging
  group;
- :mod:`~overlapkit.ft.refusals`: what does not run under torchft's
  ``DistributedDataParallel`` (``overlap_ddp``, ``post_local_sgd``), refused up front.

Importing this package does not import torchft; :func:`local_sgd` does.
See ``docs/fault_tolerance.rst``.

.. versionadded:: 0.4
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from overlapkit.ft.optimizer import STATE_DICT_KEY, FaultTolerantLocalSGD, local_sgd
    from overlapkit.ft.replicas import ManagedReplicas

__all__ = ["STATE_DICT_KEY", "FaultTolerantLocalSGD", "ManagedReplicas", "local_sgd"]

# Lazy: overlapkit.local_sgd and overlapkit.overlap import this package's refusals, and
# its local_sgd module imports overlapkit.local_sgd; loading on first use keeps the
# module graph free of circles.
_HOMES = {"STATE_DICT_KEY": "overlapkit.ft.optimizer",
          "FaultTolerantLocalSGD": "overlapkit.ft.optimizer",
          "local_sgd": "overlapkit.ft.optimizer",
          "ManagedReplicas": "overlapkit.ft.replicas"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'overlapkit.ft' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
