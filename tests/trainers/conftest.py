"""The trainer tests' ranks start with the trainer frameworks imported.

:func:`overlapkit.distributed.run_distributed` forks each rank from a server that has
imported torch (:data:`~overlapkit.distributed.PRELOADED`); every rank here then
imported transformers and its Trainer (1.9 s of CPU, measured on torch 2.13 and
transformers 5.24 on the 2-core machine) or Lightning (1.9 s) on its own. The server
imports them once instead, where they are installed (it skips a module it cannot
import), and only for the test processes that run a trainer test: the server starts
with the first run of its process, so a process that started ranks for another test
first keeps its server as it was (slower, not different).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import overlapkit.distributed

#: imported once by the rank server, beside torch
TRAINER_MODULES = ("transformers", "transformers.trainer", "accelerate", "lightning.pytorch")


@pytest.fixture(autouse=True, scope="session")
def _ranks_start_with_the_trainers_imported() -> Iterator[None]:
    missing = [name for name in TRAINER_MODULES if name not in overlapkit.distributed.PRELOADED]
    overlapkit.distributed.PRELOADED = (*overlapkit.distributed.PRELOADED, *missing)
    yield
