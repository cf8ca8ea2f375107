"""The loops of tests/test_released_optimizer.py: an overlapped optimizer released after
its first step (``opt.release()``), then stepped by a loop that clips itself or not,
with a ``torch.amp.GradScaler`` driving it or not, against the same loop on the plain
optimizer. On one process (a plain module, ``optimizer_in_backward``) or, in
:func:`run`, on DDP (2 gloo ranks, ``overlap_ddp`` and ``optimizer_in_backward``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from helpers import rank_batches
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

#: how the overlapped optimizer is set up: each of its rules
SET_UPS = ("bare", "clip_grad_norm", "clip_grad_value", "grad_scaler")
_OPTIONS = {"bare": {}, "clip_grad_norm": {"clip_grad_norm": 0.5},
            "clip_grad_value": {"clip_grad_value": 0.05}}


def _clip(params: list[torch.Tensor], clip: str) -> None:
    """The loop's own clip before ``step()``."""
    if clip == "clip_grad_norm_":
        torch.nn.utils.clip_grad_norm_(params, 0.5)
    elif clip == "halves":
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, 0.5, norm)
    elif clip == "clip_grad_value_":
        torch.nn.utils.clip_grad_value_(params, 0.05)


def run_loop(technique: str | None, set_up: str, clip: str, scaler: str | None,
             rank: int = 0, ddp: bool = False) -> tuple[list[torch.Tensor], float]:
    """4 AdamW steps, released after the first (the plain loop: the plain optimizer,
    clipping where the set-up clip stands for the loop's); ``scaler``: None, ``"step"``
    (``scaler.step(opt)``) or ``"unscale"`` (``scaler.unscale_(opt)``, then the loop's
    ``clip``), from the second step, whose third overflows and is skipped. Returns the
    parameters and the scaler's scale (0.0 without one)."""
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    if ddp:
        model = DDP(model)
    params = list(model.parameters())
    amp = None if scaler is None else torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt: Any = torch.optim.AdamW(params, lr=0.01)
    if technique is not None:
        options = dict(_OPTIONS.get(set_up, {}))
        if set_up == "grad_scaler":
            options["grad_scaler"] = amp or torch.amp.GradScaler("cpu")
        opt = getattr(overlapkit, technique)(model, opt, **options)
    # the plain loop clips as the set-up clip would where the loop does not
    set_up_clip = {"clip_grad_norm": "clip_grad_norm_", "clip_grad_value": "clip_grad_value_"
                   }.get(set_up, "none")
    plain_clip = set_up_clip if clip == "none" else clip
    for step, batch in enumerate(rank_batches(rank, 4, (4, 16))):
        loss = model(batch).square().sum()
        if step == 0 or amp is None:
            loss.backward()
            # the first step of the overlapped optimizer: its set-up clip, in backward
            if step == 0:
                _clip(params, set_up_clip if technique is None else "none")
            else:
                _clip(params, plain_clip if technique is None else clip)
            opt.step()
        else:
            amp.scale(loss * (math.inf if step == 2 else 1.0)).backward()
            if scaler == "unscale" or technique is None:
                amp.unscale_(opt)
                _clip(params, plain_clip if technique is None else clip)
            amp.step(opt)
            amp.update()
        opt.zero_grad()
        if step == 0 and technique is not None:
            opt.release()
    return [p.detach().clone() for p in params], 0.0 if amp is None else amp.get_scale()


def run(rank: int, world_size: int) -> dict[str, str]:
    """Each set-up and loop on DDP, under both techniques: "bitwise" or what differed."""
    found: dict[str, str] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        for set_up in SET_UPS:
            for clip, scaler in (("none", None), ("clip_grad_norm_", None), ("none", "step"),
                                 ("clip_grad_norm_", "unscale")):
                if set_up == "grad_scaler" and scaler is None:
                    continue
                key = f"{technique} {set_up} {clip} {scaler}"
                try:
                    plain = run_loop(None, set_up, clip, scaler, rank, ddp=True)
                    got = run_loop(technique, set_up, clip, scaler, rank, ddp=True)
                except Exception as error:  # reported to the test
                    found[key] = f"{type(error).__name__}: {error}"
                    continue
                same = got[1] == plain[1] and all(
                    torch.equal(a, b) for a, b in zip(plain[0], got[0], strict=True))
                found[key] = "bitwise" if same else "differs"
    return found
