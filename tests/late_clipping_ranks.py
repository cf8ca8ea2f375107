"""The rank side of ``tests/test_late_clipping.py``: ``torch.nn.utils.clip_grad_norm_``
after a backward in which ``overlap_ddp`` / ``optimizer_in_backward`` on a DDP model
already stepped, on 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import torch
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS, LR, CLIP = 4, 0.05, 0.05


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def _train(technique: str | None, clip_after: float | None,
           setup: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Train STEPS steps; the loop clips with clip_grad_norm_(..., clip_after) after
    backward. Returns the parameters and the norms the clip returned."""
    ddp = DDP(model())
    opt: Any = (torch.optim.AdamW(ddp.parameters(), lr=LR) if technique is None
                else getattr(overlapkit, technique)(ddp, torch.optim.AdamW, lr=LR, **setup))
    norms = []
    for x in rank_batches(torch.distributed.get_rank(), STEPS):
        ddp(x).square().mean().backward()
        if clip_after is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip_after))
        opt.step()
        opt.zero_grad()
    return values(ddp), norms


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plain, plain_norms = _train(None, CLIP, {})
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        ours, norms = _train(technique, CLIP, {"clip_grad_norm": CLIP})
        out[f"{technique} answers the clip it applied"] = (
            compare(plain, ours) and compare(plain_norms, norms))
        out[f"{technique} refuses a clip it did not apply"] = error_of(
            lambda t=technique: _train(t, CLIP, {}))
        out[f"{technique} refuses another max_norm"] = error_of(
            lambda t=technique: _train(t, 2 * CLIP, {"clip_grad_norm": CLIP}))
    # a norm only (max_norm=inf): overlap_ddp kept the gradients it stepped with
    unclipped, _ = _train(None, None, {})
    ddp_ours, ddp_norms = _train("overlap_ddp", float("inf"), {})
    _, plain_inf_norms = _train(None, float("inf"), {})
    out["overlap_ddp answers a norm-only clip with the gradients' norm"] = (
        compare(unclipped, ddp_ours) and compare(plain_inf_norms, ddp_norms))
    return out
