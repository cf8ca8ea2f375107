"""The rank side of tests/test_rebuild.py: a new optimizer built on a DDP model an
overlapkit optimizer already steps (:mod:`overlapkit.overlap.rebuild`), against the
plain loop doing the same, on gloo ranks.

Each function returns what differed (a :class:`~helpers.Comparison`), the errors raised
(:func:`~helpers.error_of`) or the figures measured, so that a failing test says what.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

HOWS = ("reassign", "del", "release")
#: the overlapped set-ups rebuilt: (technique function, its options)
VARIANTS: dict[str, tuple[Any, dict[str, Any]]] = {
    "overlap_ddp": (overlapkit.overlap_ddp, {}),
    "sharded": (overlapkit.overlap_ddp, {"shard_optimizer_state": True}),
    "optimizer_in_backward": (overlapkit.optimizer_in_backward, {}),
}


def _ddp() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)))


def _train(model: nn.Module, opt: Any, data: list[torch.Tensor]) -> None:
    for x in data:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _plain(data: list[torch.Tensor]) -> DDP:
    """Adam for 2 steps, then a new SGD for 2: the plain loop."""
    model = _ddp()
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), data[:2])
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), data[2:])
    return model


def rebuilds(rank: int, world_size: int, variants: list[str]) -> dict[str, Any]:
    """For each variant and each way to drop the first optimizer (:data:`HOWS`): Adam
    in backward for 2 steps, the same call with SGD for 2; the parameters against the
    plain loop, the retired optimizer's later use, and whether the first optimizer and
    its stepper were collected (no thread left behind)."""
    data = rank_batches(rank, 4, shape=(8, 16))
    reference = values(_plain(data))
    out: dict[str, Any] = {}
    for variant in variants:
        build, options = VARIANTS[variant]
        for how in HOWS:
            model = _ddp()
            opt = build(model, torch.optim.Adam, lr=1e-2, **options)
            _train(model, opt, data[:2])
            first, stepper = weakref.ref(opt), weakref.ref(opt._steps)
            kept = opt if how == "reassign" else None
            if how == "release":
                opt.release()
            if how != "reassign":
                del opt
                gc.collect()
            opt = build(model, torch.optim.SGD, lr=0.1, **options)
            _train(model, opt, data[2:])
            result: dict[str, Any] = {"parity": compare(reference, values(model))}
            if kept is not None:
                result["step"] = error_of(kept.step)
                result["zero_grad"] = error_of(kept.zero_grad)
                result["release"] = error_of(kept.release)  # a no-op
                result["state_dict"] = error_of(kept.state_dict)  # still reads
                del kept
            del opt, model
            gc.collect()
            dist.barrier()
            result["collected"] = first() is None and stepper() is None
            result["threads"] = threading.active_count()
            out[f"{variant} {how}"] = result
    return out


def plain_after_drop(rank: int, world_size: int) -> dict[str, Any]:
    """overlap_ddp with Adam for 2 steps, then a plain SGD on the same DDP model for 2:
    with the overlapped optimizer released, bitwise the plain loop; still held, or
    dropped (``del``, collected: the model's comm hook still steps it, on every rank),
    the SGD's first step is refused (the parameters as the backward left them)."""
    data = rank_batches(rank, 4, shape=(8, 16))
    reference = values(_plain(data))
    out: dict[str, Any] = {}
    for how in ("released", "dropped", "held"):
        model = _ddp()
        opt = overlapkit.overlap_ddp(model, torch.optim.Adam, lr=1e-2)
        _train(model, opt, data[:2])
        if how == "released":
            opt.release()
        held = opt if how == "held" else None
        del opt
        gc.collect()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        if how == "released":
            _train(model, sgd, data[2:])
            out[how] = compare(reference, values(model))
            continue
        model(data[2]).square().mean().backward()
        before = values(model)
        out[how] = error_of(sgd.step)
        out[f"{how}: unchanged by the refused step"] = compare(before, values(model))
        del held
    return out


def switch_technique(rank: int, world_size: int) -> dict[str, Any]:
    """overlap_ddp with Adam for 2 steps, then optimizer_in_backward with SGD on the same
    DDP model: refused while the first is live (a DDP model takes one comm hook);
    after ``release()``, bitwise the plain loop."""
    data = rank_batches(rank, 4, shape=(8, 16))
    model = _ddp()
    opt = overlapkit.overlap_ddp(model, torch.optim.Adam, lr=1e-2)
    _train(model, opt, data[:2])
    refused = error_of(lambda: overlapkit.optimizer_in_backward(model, torch.optim.SGD,
                                                                lr=0.1))
    opt.release()
    _train(model, overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1), data[2:])
    return {"refused": refused, "parity": compare(values(_plain(data)), values(model))}


class _Branchy(nn.Module):
    """A head ``c`` that some steps leave unused (``find_unused_parameters=True``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_c: bool = True) -> torch.Tensor:
        h = self.a(x).tanh()
        return self.b(h) + self.c(h) if use_c else self.b(h)


def rebuilds_tracking_usage(rank: int, world_size: int) -> dict[str, Any]:
    """Adam for 2 steps, then a new SGD with momentum for 2, on a DDP model with
    ``static_graph=True`` or ``find_unused_parameters=True`` (``c`` unused on alternate
    steps, not the same on each rank): the parameters and state against the plain loop."""
    data = rank_batches(rank, 4, shape=(8, 16))
    out: dict[str, Any] = {}
    for option in ("static_graph", "find_unused_parameters"):
        def train(technique: str | None, option: str = option) -> list[torch.Tensor]:
            model = DDP(_Branchy(), **{option: True})
            opt: Any = None
            for i, x in enumerate(data):
                if i in (0, 2):
                    cls, kw = (torch.optim.Adam, {"lr": 1e-2}) if i == 0 else (
                        torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
                    opt = cls(model.parameters(), **kw) if technique is None else \
                        getattr(overlapkit, technique)(model, cls, **kw)
                use_c = option == "static_graph" or (i + rank) % 2 == 0
                model(x, use_c).square().mean().backward()
                opt.step()
                opt.zero_grad()
            state = opt.state_dict()["state"]
            return values(model) + [v for k in sorted(state) for v in state[k].values()]
        plain = train(None)
        for technique in ("overlap_ddp", "optimizer_in_backward"):
            out[f"{technique} {option}"] = compare(plain, train(technique))
    return out


def new_ddp_after_unfreezing(rank: int, world_size: int) -> dict[str, Any]:
    """Adam on a DDP model whose first layer is frozen for 2 steps, the optimizer dropped
    (``del``, not released), the layer unfrozen, a new DDP model built around the same
    module and SGD on it for 2: for each technique, the new call set up (the dropped
    model and its optimizer were collected) and the parameters against the plain loop."""
    data = rank_batches(rank, 4, shape=(8, 16))

    def train(technique: str | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        inner[0].requires_grad_(False)
        for i, cls, kw in ((0, torch.optim.Adam, {"lr": 1e-2}), (2, torch.optim.SGD, {"lr": 0.1})):
            model = DDP(inner)
            opt = (cls([p for p in model.parameters() if p.requires_grad], **kw)
                   if technique is None else getattr(overlapkit, technique)(model, cls, **kw))
            _train(model, opt, data[i:i + 2])
            del model, opt
            gc.collect()
            inner[0].requires_grad_(True)
        return values(inner)

    plain = train(None)
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        try:
            out[technique] = compare(plain, train(technique))
        except Exception as error:  # what the test reports
            out[technique] = f"{type(error).__name__}: {error}"
    return out


def dropped_then_plain_following_the_advice(rank: int, world_size: int) -> dict[str, Any]:
    """Adam in backward for 2 steps, the optimizer dropped (``del``: the model's comm
    hook steps it on), a plain AdamW built: its first step is refused (the backward
    stepped by the dropped Adam); the loop follows the refusal's advice — the call it
    names, released, then the AdamW's ``zero_grad()`` — and trains on with the AdamW:
    against the plain loop (Adam for 3 steps, AdamW for 2). Also the other technique
    set up instead of the AdamW after the same advice."""
    data = rank_batches(rank, 5, shape=(8, 16))
    plain = _ddp()
    _train(plain, torch.optim.Adam(plain.parameters(), lr=1e-2), data[:3])
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), data[3:])
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        call = getattr(overlapkit, technique)
        for then in ("plain", "other"):
            key = f"{technique} then {then}"
            model = _ddp()
            opt = call(model, torch.optim.Adam, lr=1e-2)
            _train(model, opt, data[:2])
            del opt
            gc.collect()
            adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model(data[2]).square().mean().backward()
            error = error_of(adamw.step)
            advice = f"overlapkit.{technique}(model, torch.optim.SGD).release()"
            if error is None or advice not in error["message"]:
                out[key] = error
                continue
            try:
                call(model, torch.optim.SGD).release()  # the advice
                adamw.zero_grad()
                if then == "other":
                    other = "optimizer_in_backward" if technique == "overlap_ddp" else \
                        "overlap_ddp"
                    adamw = getattr(overlapkit, other)(model, torch.optim.AdamW, lr=1e-2)
                _train(model, adamw, data[3:])
                out[key] = compare(values(plain), values(model))
            except Exception as error:  # what the test reports
                out[key] = f"{type(error).__name__}: {error}"
    return out
