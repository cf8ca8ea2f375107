"""A comm hook replacing its bucket's buffer (``bucket.set_buffer``): torch's
``fp16_compress_wrapper(powerSGD_hook)``, registered by a plugin, on 2 gloo ranks,
bitwise plain DDP with the same hook registered by hand. At ``cdd1705`` the first
backward failed with torch's bare "attempting to assign a gradient with dtype
'c10::Half' to a tensor with grad_dtype 'Float'" (``overlap/ddp/replaced_buffers.py``)."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import overlapkit
from overlapkit.plugin import CommHookRecord, hookimpl
from overlapkit.plugin.manager import create_plugin_manager, set_plugin_manager

HOOKS = {
    "fp16_allreduce": default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
    "fp16_powersgd": default_hooks.fp16_compress_wrapper(psgd.powerSGD_hook),
}


def _state(name: str, process_group: Any) -> Any:
    if name == "fp16_powersgd":
        return psgd.PowerSGDState(process_group=process_group, matrix_approximation_rank=1,
                                  start_powerSGD_iter=2, random_seed=0)
    return process_group


def _plugin() -> types.ModuleType:
    module = types.ModuleType("set_buffer_hooks")

    def build_for(name: str) -> Any:
        def build(*, process_group: Any = None, **options: Any) -> tuple[Any, Any]:
            return _state(name, process_group), HOOKS[name]
        return build

    @hookimpl
    def overlapkit_register_comm_hooks() -> list[CommHookRecord]:
        return [CommHookRecord(name=name, build=build_for(name)) for name in HOOKS]

    module.overlapkit_register_comm_hooks = overlapkit_register_comm_hooks  # type: ignore[attr-defined]
    return module


def _train(rank: int, name: str, technique: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 2))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    opt: Any = torch.optim.Adam(ddp.parameters(), lr=0.01)
    if technique is None:
        ddp.register_comm_hook(_state(name, None), HOOKS[name])
    else:
        opt = getattr(overlapkit, technique)(ddp, opt, comm_hook=name)
    for step in range(5):
        batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))
        ddp(batch).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _rank(rank: int, world_size: int, name: str, technique: str) -> bool:
    pm = create_plugin_manager(autoload=False, disabled=(), trace=False)
    pm.register(_plugin(), name="set_buffer_hooks")
    set_plugin_manager(pm)
    plain = _train(rank, name, None)
    return all(torch.equal(a, b)
               for a, b in zip(plain, _train(rank, name, technique), strict=True))


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("name", ["fp16_allreduce"])  # fp16_powersgd: see CHANGELOG
def test_a_hook_replacing_the_bucket_buffer_trains_as_plain_ddp(
        run_distributed: Any, name: str, technique: str) -> None:
    assert run_distributed(_rank, 2, args=(name, technique), timeout=400) == [True, True]
