"""Whether the DDP model's own process group is still registered with torch, checked
before a sharded optimizer's gathering and ``overlapkit.checkpoint``'s save or load
(:func:`raise_if_groups_gone`).

A DDP model built on a subgroup (``DDP(module, process_group=dist.new_group(...))``)
holds the group itself: after ``dist.destroy_process_group(group)`` it trains on, and so
does the sharded optimizer (its exchange has a group of its own), bitwise plain DDP. What
looks the group up in torch's registry does not: up to 0.4.0
``consolidate_state_dict()`` and ``overlapkit.checkpoint.save`` / ``load`` raised
torch's bare ``ValueError`` ("Group <...ProcessGroup object at 0x...> is not
registered, please create group with torch.distributed.new_group API") from inside the
gathering and the buffers' broadcast (measured: 2 gloo ranks, AdamW; nothing gathered or
written). They are now refused with what to do, before any collective, on every rank that
destroyed the group (not on a group of one rank, where they look nothing up and work). A
check of a dict's keys, made by these calls only (nothing per step).

.. versionadded:: 0.4
"""

from __future__ import annotations

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.sharded.stepper import ShardedBucketStepper

__all__ = ["raise_if_groups_gone"]


def raise_if_groups_gone(stepper: ShardedBucketStepper, model: DistributedDataParallel,
                         what: str) -> None:
    """Before ``what`` (a gathering, a checkpoint's save or load): refused where the
    exchange's process groups were destroyed (:meth:`~overlapkit.overlap.sharded.stepper.
    ShardedBucketStepper.raise_if_destroyed`) or where the DDP model's own group is no
    longer registered (the module docstring).

    :raises ConfigurationError: either; nothing gathered, written or read."""
    stepper.raise_if_destroyed(what)
    group = getattr(model, "process_group", None)
    if group is None or group in dist.distributed_c10d._world.pg_map or group.size() == 1:
        return  # (a group of one rank: nothing is looked up, the calls work as before)
    raise ConfigurationError(
        f"{what}: the DDP model's process group was destroyed "
        "(dist.destroy_process_group(group)) while the model still uses it. DDP and this "
        "sharded optimizer train on without it being registered, but this call finds the "
        "group's ranks through torch's registry, which no longer holds it. Nothing was "
        "gathered, written or read. Destroy the group after the last save instead; or save "
        "without it: torch.distributed.checkpoint.save({'optim': optimizer}, ...) on every "
        "rank (each rank's share, on the default group), or local_state_dict() (this "
        "rank's share); or wrap the module in a new DDP model on a live group and call "
        "overlap_ddp again."
    )
