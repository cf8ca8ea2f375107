"""The rank side of tests/test_window.py: what a loop does between a backward that
stepped and ``step()`` — a gradient changed (from the first step on), a hyperparameter
changed (a hand-written warm-up, ``lr_scheduler.step()`` first), ``zero_grad()``, a second
``step()``, torch's two halves of ``clip_grad_norm_`` — refused at that ``step()`` (or
call) on every rank, or, where the technique keeps what the plain loop reads, bitwise
the plain loop (2 gloo ranks, DDP)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

EDITS = ("in place", "replaced", "none")
TECHNIQUES = ("overlap_ddp", "optimizer_in_backward")


def _edited_after_stepping(rank: int, technique: str, edit: str) -> dict[str, Any] | None:
    """Two ordinary steps, then a third whose gradients the loop changes before step()."""
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)),
              bucket_cap_mb=0.001)
    build = getattr(overlapkit, technique)
    opt = build(ddp, torch.optim.AdamW, lr=1e-2)
    for batch in rank_batches(rank, 2):
        ddp(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ddp(rank_batches(rank, 3)[2]).square().mean().backward()
    weight = ddp.module[0].weight
    if edit == "in place" and weight.grad is not None:
        weight.grad.mul_(0.5)
    elif edit != "none":
        weight.grad = torch.zeros_like(weight)
    return error_of(opt.step)


def _model() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)),
               bucket_cap_mb=0.001)


def _loop(rank: int, technique: str | None, window: Callable[[Any, Any, int], Any],
          after_step: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Three steps of ``backward, window(ddp, opt, i), step() (unless the window says
    "skip"), [after_step(opt)], zero_grad()``, plainly (``technique`` None) or
    overlapped: what was raised where, the parameters then and whether the call that
    raised changed them (a call in the window: the gradients)."""
    ddp = _model()
    params = list(ddp.parameters())
    if technique is None:
        opt: Any = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    else:
        opt = getattr(overlapkit, technique)(ddp, torch.optim.SGD, lr=1e-2, momentum=0.9)
    found: dict[str, Any] = {"error": None, "at": None}
    for i, batch in enumerate(rank_batches(rank, 3)):
        ddp(batch).square().mean().backward()
        grads = [p.grad.clone() for p in params if p.grad is not None]
        skips: list[Any] = []
        found["error"] = error_of(lambda: skips.append(window(ddp, opt, i)))  # noqa: B023
        if found["error"] is not None:
            found["at"] = i
            found["unchanged by it"] = compare(
                grads, [p.grad for p in params if p.grad is not None])
            break
        if skips == ["skip"]:
            continue
        before = values(ddp)
        found["error"] = error_of(opt.step)
        if found["error"] is None and after_step is not None:
            before = values(ddp)
            found["error"] = error_of(lambda: after_step(opt))
        if found["error"] is not None:
            found["at"] = i
            found["unchanged by it"] = compare(before, values(ddp))
            break
        opt.zero_grad()
    found["values"] = values(ddp)
    return found


def _warm_up(ddp: Any, opt: Any, i: int) -> None:
    for group in opt.param_groups:  # the plain step() uses the new lr
        group["lr"] = 1e-2 * (i + 1) / 3


def _scheduler_first() -> Callable[[Any, Any, int], None]:
    schedulers: dict[int, Any] = {}

    def window(ddp: Any, opt: Any, i: int) -> None:
        if id(opt) not in schedulers:
            schedulers[id(opt)] = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        with warnings.catch_warnings():  # torch's own "scheduler before step" warning
            warnings.simplefilter("ignore")
            schedulers[id(opt)].step()
    return window


def _halve_first_gradients(ddp: Any, opt: Any, i: int) -> None:
    if i == 0:
        for param in ddp.parameters():
            if param.grad is not None:
                param.grad.mul_(0.5)


def _zero_grad(ddp: Any, opt: Any, i: int) -> None:
    opt.zero_grad()


def _skip_second_step(ddp: Any, opt: Any, i: int) -> str | None:
    if i == 1:  # as on a non-finite gradient norm: no step() for this backward
        opt.zero_grad()
        return "skip"
    return None


def _clip_in_two_halves(ddp: Any, opt: Any, i: int) -> None:
    params = list(ddp.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FreedGradientNormWarning: pinned in test_window
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, 0.05, norm)


def _clamp_parameters(ddp: Any, opt: Any, i: int) -> None:
    with torch.no_grad():  # a weight constraint written before step(), not after
        for param in ddp.parameters():
            param.clamp_(-0.1, 0.1)


def _scale_momentum(ddp: Any, opt: Any, i: int) -> None:
    if i == 1:  # the plain step() starts from the scaled buffer
        opt.state[ddp.module[0].weight]["momentum_buffer"].mul_(0.5)


def _clear_state_entry(ddp: Any, opt: Any, i: int) -> None:
    if i == 1:  # the plain step() starts a new momentum buffer
        opt.state[ddp.module[2].bias].clear()


#: name -> (what the loop does between backward and step(), returning "skip" to skip
#: that step(); what it does after step())
WINDOWS: dict[str, tuple[Callable[[Any, Any, int], Any], Callable[[Any], None] | None]] = {
    "warm-up": (_warm_up, None),
    "scheduler first": (_scheduler_first(), None),
    "first gradients halved": (_halve_first_gradients, None),
    "zero_grad": (_zero_grad, None),
    "skipped step": (_skip_second_step, None),
    "step twice": (lambda ddp, opt, i: None, lambda opt: opt.step()),
    "clip in two halves": (_clip_in_two_halves, None),
    "parameters clamped": (_clamp_parameters, None),
    "momentum scaled": (_scale_momentum, None),
    "state entry cleared": (_clear_state_entry, None),
}


def _backward_twice(rank: int, technique: str) -> dict[str, Any]:
    """After two ordinary steps, two backwards through one kept graph before step()
    (an auxiliary loss): what the second raised, and whether it changed anything."""
    ddp = _model()
    opt = getattr(overlapkit, technique)(ddp, torch.optim.AdamW, lr=1e-2)
    batches = rank_batches(rank, 3)
    for batch in batches[:2]:
        ddp(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
    loss = ddp(batches[2]).square().mean()
    loss.backward(retain_graph=True)
    params = list(ddp.parameters())
    before = values(ddp) + [p.grad.clone() for p in params if p.grad is not None]
    error = error_of(lambda: (0.5 * loss).backward())
    after = values(ddp) + [p.grad.clone() for p in params if p.grad is not None]
    return {"error": error, "unchanged by it": compare(before, after)}


def _noisy_loop(rank: int, technique: str | None,
                ema: bool = False) -> tuple[list[torch.Tensor], list[str]]:
    """Three steps adding gradient noise between backward and step() (Accelerate's
    guide does), or updating an EMA of the parameters there (``ema``: its values
    returned after the model's), the overlapped optimizer told to learn the loop at its
    first step."""
    ddp = _model()
    if technique is None:
        opt: Any = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    else:
        opt = getattr(overlapkit, technique)(ddp, torch.optim.AdamW, lr=1e-2)
        opt.learn_first_step(ddp)
    noise = torch.Generator().manual_seed(7)
    average = torch.optim.swa_utils.AveragedModel(ddp.module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in rank_batches(rank, 3):
            ddp(batch).square().mean().backward()
            if ema:
                average.update_parameters(ddp.module)
            else:
                for param in ddp.parameters():
                    param.grad.add_(torch.randn(param.shape, generator=noise), alpha=1e-3)
            opt.step()
            opt.zero_grad()
    return values(ddp) + (values(average) if ema else []), [str(w.message) for w in caught]


def _sharded_reads(rank: int, ema: bool) -> list[str]:
    """The warnings of four sharded steps, an EMA updated between backward and step()
    or not (the exchange writes the parameters after a backward: not the loop's read)."""
    ddp = _model()
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=1e-2, shard_optimizer_state=True)
    average = torch.optim.swa_utils.AveragedModel(ddp.module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in rank_batches(rank, 4):
            ddp(batch).square().mean().backward()
            if ema:
                average.update_parameters(ddp.module)
            opt.step()
            opt.zero_grad()
    return [type(w.message).__name__ for w in caught]


def run(rank: int, world_size: int) -> dict[str, Any]:
    found: dict[str, Any] = {
        f"{technique} {edit}": _edited_after_stepping(rank, technique, edit)
        for technique in TECHNIQUES for edit in EDITS}
    for name, (window, after_step) in WINDOWS.items():
        plain = _loop(rank, None, window, after_step)
        for technique in TECHNIQUES:
            ours = _loop(rank, technique, window, after_step)
            ours["bitwise plain"] = (plain["error"] is None and ours["error"] is None
                                     and compare(plain["values"], ours["values"]))
            del ours["values"]
            found[f"{technique} {name}"] = ours
    expected, _ = _noisy_loop(rank, None)
    for technique in TECHNIQUES:
        found[f"{technique} backward twice"] = _backward_twice(rank, technique)
        ours, said = _noisy_loop(rank, technique)
        found[f"{technique} learned"] = {"bitwise plain": compare(expected, ours),
                                         "warnings": said}
    found["sharded reads"] = {ema: _sharded_reads(rank, ema) for ema in (False, True)}
    expected, _ = _noisy_loop(rank, None, ema=True)
    for technique in TECHNIQUES:  # 0.4.0: the EMA and model 0.0067 off after 3 steps, silently
        ours, said = _noisy_loop(rank, technique, ema=True)
        found[f"{technique} learned ema"] = {"bitwise plain": compare(expected, ours),
                                             "warnings": said}
    return found
