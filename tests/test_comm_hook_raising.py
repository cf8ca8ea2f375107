"""A comm hook (a plugin's) whose future fails in a later bucket, on 2 gloo ranks: the
buckets before it were stepped during backward, where plain DDP raises after backward
with nothing stepped. At ``cdd1705`` the hook's bare error came out, the hook unnamed
and the partial step unsaid; now a ``ConfigurationError`` naming the hook and the
bucket and saying so (``overlapkit/overlap/ddp/failed_reductions.py``)."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlapkit
from overlapkit.plugin import CommHookRecord, hookimpl
from overlapkit.plugin.manager import create_plugin_manager, set_plugin_manager


def late_failing_hook(state, bucket):  # type: ignore[no-untyped-def]
    """Reduces bucket 0, fails every later one (its future set to an exception)."""
    if bucket.index() == 0:
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(
            lambda f: f.value()[0])
    failed: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    failed.set_exception(RuntimeError("late bucket failed"))
    return failed


def _build(*, process_group: Any = None, **options: Any) -> tuple[Any, Any]:
    return process_group, late_failing_hook


def _rank(rank: int, world_size: int, technique: str) -> str:
    plugin = types.ModuleType("late_failing")

    @hookimpl
    def overlapkit_register_comm_hooks() -> CommHookRecord:
        return CommHookRecord(name="late_failing", build=_build, description="fails")

    plugin.overlapkit_register_comm_hooks = overlapkit_register_comm_hooks  # type: ignore[attr-defined]
    pm = create_plugin_manager(autoload=False, disabled=(), trace=False)
    pm.register(plugin, name="late_failing")
    set_plugin_manager(pm)
    torch.manual_seed(0)
    # the first bucket (1 MiB) holds the last layers; the first layers come later
    model = nn.Sequential(nn.Linear(8, 600), nn.Tanh(), nn.Linear(600, 512), nn.Tanh(),
                          nn.Linear(512, 2))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.5)
    opt = getattr(overlapkit, technique)(
        ddp, torch.optim.Adam(ddp.parameters(), lr=0.01), comm_hook="late_failing")
    for _ in range(2):  # the buckets are DDP's rebuilt ones from the second backward
        try:
            ddp(torch.randn(4, 8)).sum().backward()
        except overlapkit.ConfigurationError as error:
            assert isinstance(error.__cause__, RuntimeError)
            return str(error)
        opt.step()
        opt.zero_grad()
    return "no error"


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_a_hook_failing_in_a_later_bucket_is_named_and_the_partial_step_said(
        run_distributed: Any, technique: str) -> None:
    for message in run_distributed(_rank, 2, args=(technique,)):
        assert "late_failing_hook failed reducing gradient bucket 1" in message
        assert "RuntimeError: late bucket failed" in message
        assert "stepped already" in message and "restart from the last checkpoint" in message
