"""Rank code of tests/trainers/test_lightning_after_step.py: a module whose
``lr_scheduler_step`` override reads ``.grad`` (after the optimizer step, before the next
``zero_grad``, where the plain loop still holds that step's gradients) from the third
step on, stepping its scheduler only while their norm is above a bar; against the plain
strategy's fit: the parameters, bitwise, the norms it read, and the warnings."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from helpers import compare
from lightning_models import Regression, data, quiet, trainer, values
from lightning_parity_ranks import strategy

PAIRS = {1: {"overlap_ddp": "ddp", "optimizer_in_backward": "ddp",
             "one device": "single device"},
         2: {"overlap_ddp": "ddp", "optimizer_in_backward": "ddp"}}


class SchedulesOnGradients(Regression):
    """Steps the LR scheduler only while the gradients' norm is above 0.05, from the
    third step on (before: always); the norms read."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[float] = []

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        if self.global_step >= 3:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            norm = float(torch.stack([g.norm() for g in grads]).norm()) if grads else 0.0
        else:
            norm = 1.0
        self.norms.append(norm)
        if norm > 0.05:
            scheduler.step()


def _fit(label: str, world_size: int, root: Path) -> tuple[list[torch.Tensor], list[float]]:
    module = SchedulesOnGradients()
    trainer(strategy(label), world_size, root, max_epochs=1).fit(module, data())
    return values(module), module.norms


def run(rank: int, world_size: int, root: str) -> dict[str, Any]:
    quiet()
    plain = {p: _fit(p, world_size, Path(root) / p) for p in set(PAIRS[world_size].values())}
    out: dict[str, Any] = {}
    for label, plain_label in PAIRS[world_size].items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            params, norms = _fit(label, world_size, Path(root) / label)
        out[label] = (bool(compare(plain[plain_label][0], params))
                      and norms == plain[plain_label][1])
        out[f"{label} | warnings"] = [str(w.message) for w in caught
                                      if "in the plain order" in str(w.message)]
    return out
