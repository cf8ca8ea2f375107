"""``comm_hook="bf16_compress"`` on gloo (CPU), where plain DDP refuses torch's
``bf16_compress_hook`` by its name on a torch built without CUDA 11+ and NCCL 2.10+
("BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+ or XPU and
XCCL", DDP's ``_check_comm_hook``): torch checks the build, not the backend, and gloo
reduces bfloat16. overlapkit registers its own hook, which runs torch's, so the check
does not apply: pinned here, bitwise plain DDP running the same hook under another
name (2 gloo ranks); documented in ``overlapkit.comm_hooks``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import overlapkit
from overlapkit.plugin.manager import create_plugin_manager, set_plugin_manager


def bf16_by_another_name(state, bucket):  # type: ignore[no-untyped-def]
    """torch's ``bf16_compress_hook``, under a name DDP's check does not refuse."""
    return default_hooks.bf16_compress_hook(state, bucket)


def _train(rank: int, technique: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 2))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    opt: Any = torch.optim.Adam(ddp.parameters(), lr=0.01)
    if technique is None:
        ddp.register_comm_hook(None, bf16_by_another_name)
    else:
        opt = getattr(overlapkit, technique)(ddp, opt, comm_hook="bf16_compress")
    for step in range(4):
        batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))
        ddp(batch).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _rank(rank: int, world_size: int, technique: str) -> tuple[str, bool]:
    set_plugin_manager(create_plugin_manager(autoload=False, disabled=(), trace=False))
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    try:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        plain_refuses = "registered"
    except TypeError as error:  # this torch build: no CUDA/NCCL
        plain_refuses = str(error)
    plain = _train(rank, None)
    return plain_refuses, all(torch.equal(a, b)
                              for a, b in zip(plain, _train(rank, technique), strict=True))


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_bf16_compress_on_gloo_trains_as_plain_ddp_with_the_same_hook(
        run_distributed: Any, technique: str) -> None:
    results = run_distributed(_rank, 2, args=(technique,), timeout=400)
    assert [same for _, same in results] == [True, True]
    if torch.version.cuda is None and torch.version.hip is None:
        assert all("BF16 all reduce" in refused for refused, _ in results)
