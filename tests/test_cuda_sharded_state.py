"""Sharded optimizer state on a GPU (marked ``cuda``, skipped without one): the steps and
the parameter exchange on the side stream (:mod:`overlapkit.overlap.core.side_stream`),
bitwise plain DDP.

One GPU is enough: one NCCL rank (the whole state on it, the side-stream steps and
everything around the exchange), and two ranks sharing the GPU over gloo, whose
broadcasts take CUDA tensors (NCCL refuses two ranks on one device), which runs the
exchange itself: issued from the side stream after the bucket's step, received in place
and into buffers on it, the compute stream waiting for it before the next forward.
``benchmarks/gpu_sharded_check.sh`` runs these and a short timing (and
``benchmarks/gpu_check.sh``, every ``tests/test_cuda_*.py``, runs them too).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import compare, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.distributed import run_distributed

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
STEPS = 4


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    # one large weight (received in place) and small ones (received into a buffer)
    return nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 64), nn.Tanh(),
                         nn.Linear(64, 8)).to(device)


def _train(rank: int, sharded: bool, device: torch.device, delay_rank_0: bool = False,
           **setup: Any) -> dict[str, Any]:
    ddp = DDP(_model(device), device_ids=[device.index], bucket_cap_mb=0.05)
    streams: list[int] = []
    if sharded:
        opt: Any = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=0.01,
                                          shard_optimizer_state=True, **setup)
        # on the real optimizer: runs at each partial step (the sharded optimizer's own
        # step hooks are refused)
        opt.optimizer.register_step_pre_hook(
            lambda o, a, k: streams.append(torch.cuda.current_stream(device).stream_id))
        if delay_rank_0 and rank == 0:
            exchange = opt._stepper.exchange
            issue = exchange._broadcast

            def slow(buffer: torch.Tensor, source: int) -> Any:
                torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time on this stream
                time.sleep(0.05)
                return issue(buffer, source)

            exchange._broadcast = slow
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    generator = torch.Generator(device=device).manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(32, 64, device=device, generator=generator)
        loss = ddp(x).square().mean()
        losses.append(loss.detach().clone())
        loss.backward()
        if not sharded and "clip_grad_norm" in setup:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), setup["clip_grad_norm"])
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize(device)
    default = torch.cuda.default_stream(device).stream_id
    return {"values": values(ddp), "losses": losses,
            "side stream": bool(streams) and all(s != default for s in streams)}


def _parity(rank: int, world_size: int) -> dict[str, Any]:
    """Every rank on cuda:0 (two ranks share it over gloo) or on its own GPU (NCCL)."""
    device = torch.device("cuda", 0 if dist.get_backend() == "gloo" else rank)
    torch.cuda.set_device(device)
    out: dict[str, Any] = {}
    for name, setup in {"per bucket": {}, "global clip": {"clip_grad_norm": 0.05}}.items():
        plain = _train(rank, False, device, **setup)
        ours = _train(rank, True, device, **setup)
        out[name] = {"values": compare(plain["values"], ours["values"]),
                     "losses": compare(plain["losses"], ours["losses"]),
                     "side stream": ours["side stream"]}
    plain = _train(rank, False, device)
    ours = _train(rank, True, device, delay_rank_0=True)
    out["delayed exchange"] = {"values": compare(plain["values"], ours["values"]),
                               "losses": compare(plain["losses"], ours["losses"]),
                               "side stream": ours["side stream"]}
    return out


def _check(results: list[dict[str, Any]]) -> None:
    for rank, rank_results in enumerate(results):
        for case, result in rank_results.items():
            assert result["values"], (rank, case, result["values"])
            assert result["losses"], (rank, case, result["losses"])
            assert result["side stream"], (rank, case)


@pytest.mark.cuda
@cuda
def test_cuda_one_nccl_rank_steps_on_a_side_stream_bitwise() -> None:
    _check(run_distributed(_parity, 1, backend="nccl", timeout=300))


@pytest.mark.cuda
@cuda
def test_cuda_two_ranks_on_one_gpu_exchange_on_the_side_stream_bitwise() -> None:
    _check(run_distributed(_parity, 2, backend="gloo", timeout=300))


def _checkpoint(rank: int, world_size: int, path: str) -> dict[str, Any]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    ddp = DDP(_model(device), device_ids=[0], bucket_cap_mb=0.05)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=0.01, shard_optimizer_state=True)
    x = torch.randn(32, 64, device=device, generator=torch.Generator(device).manual_seed(rank))
    for _ in range(2):
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    overlapkit.checkpoint.save(path, ddp, opt)
    fresh = DDP(_model(device), device_ids=[0], bucket_cap_mb=0.05)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    reloaded = overlapkit.overlap_ddp(fresh, torch.optim.AdamW, lr=0.01,
                                      shard_optimizer_state=True)
    overlapkit.checkpoint.load(path, fresh, reloaded)
    state = [v for p in opt.owned_parameters() for v in opt.optimizer.state[p].values()]
    again = [v for p in reloaded.owned_parameters()
             for v in reloaded.optimizer.state[p].values()]
    return {"values": compare(values(ddp), values(fresh)), "state": compare(state, again),
            "on the GPU": all(v.device.type == "cuda" for v in again if v.dim() > 0)}


@pytest.mark.cuda
@cuda
def test_cuda_sharded_checkpoint_round_trip(tmp_path: Any) -> None:
    for result in run_distributed(_checkpoint, 2, args=(str(tmp_path / "ckpt"),),
                                  backend="gloo", timeout=300):
        assert result["values"] and result["state"] and result["on the GPU"], result
