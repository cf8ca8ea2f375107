"""Rank code of the Lightning tests of fits that follow a fit of the same module:
``Tuner.lr_find`` then ``fit``, ``Tuner.scale_batch_size`` then ``fit`` (Lightning's
documented tuner workflow: the tuner runs a fit of its own), and ``fit`` twice, each
bitwise the same with the plain strategy; and a backward by hand after a fit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from helpers import Comparison, compare, error_of
from lightning.pytorch.tuner import Tuner
from lightning_models import Regression, data, quiet, trainer, values
from torch.utils.data import DataLoader

#: overlapkit's strategy -> the plain one it is compared with, by world size
PAIRS = {
    2: {"overlap_ddp": "ddp", "optimizer_in_backward": "ddp"},
    1: {"overlap_ddp": "ddp", "optimizer_in_backward": "ddp",
        "one device": "single device"},
}


class Tunable(Regression):
    """Regression with the attributes the tuner sets: ``lr`` (read by
    ``configure_optimizers``) and ``batch_size`` (read by ``train_dataloader``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lr = 1e-2
        self.batch_size = 2

    def configure_optimizers(self) -> Any:
        weights = [p for n, p in self.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in self.named_parameters() if n.endswith("bias")]
        optimizer = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1},
                                       {"params": biases, "weight_decay": 0.0}], lr=self.lr)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25,
                                                      total_iters=4)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(data().dataset, batch_size=self.batch_size)


def _lr_find_then_fit(run: L.Trainer, module: Tunable) -> list[torch.Tensor]:
    found = Tuner(run).lr_find(module, num_training=6, min_lr=1e-4, max_lr=1e-1,
                               early_stop_threshold=None)
    assert found is not None
    run.fit(module)
    return [torch.tensor(found.results["lr"] + found.results["loss"] + [module.lr],
                         dtype=torch.float64)]


def _scale_batch_size_then_fit(run: L.Trainer, module: Tunable) -> list[torch.Tensor]:
    Tuner(run).scale_batch_size(module, mode="power", steps_per_trial=2, init_val=2,
                                max_trials=2)
    run.fit(module)
    return [torch.tensor([float(module.batch_size)])]


#: case -> what it does with a Trainer (max_epochs=1) and a new module; what it records
CASES: dict[str, Callable[[L.Trainer, Tunable], list[torch.Tensor]]] = {
    "Tuner.lr_find, then fit": _lr_find_then_fit,
    "Tuner.scale_batch_size, then fit": _scale_batch_size_then_fit,
}


#: Lightning tunes the batch size on one device only (a distributed strategy raises its
#: ValueError, the plain one's too)
ONE_DEVICE_ONLY = ["Tuner.scale_batch_size, then fit"]


def _fit_twice(label: str, world_size: int, root: Path) -> dict[str, Any]:
    from lightning_parity_ranks import strategy

    module = Tunable()
    for _ in range(2):  # a new Trainer (and strategy) each time, the same module
        trainer(strategy(label), world_size, root, max_epochs=1).fit(module)
    return {"values": values(module), "recorded": []}


def _run(label: str, case: str, world_size: int, root: Path) -> dict[str, Any]:
    from lightning_parity_ranks import strategy

    root.mkdir(parents=True, exist_ok=True)
    if case == "fit twice":
        return _fit_twice(label, world_size, root)
    module = Tunable()
    recorded = CASES[case](trainer(strategy(label), world_size, root, max_epochs=1), module)
    return {"values": values(module), "recorded": recorded}


def tuning(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Each case with each overlapkit strategy against the plain one, and (one device)
    a backward by hand after the fit."""
    quiet()
    base = Path(root) / "tuning"
    plain: dict[tuple[str, str], dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for label, plain_label in PAIRS[world_size].items():
        for case in [*CASES, "fit twice"]:
            if case in ONE_DEVICE_ONLY and plain_label != "single device":
                continue
            if (plain_label, case) not in plain:
                plain[plain_label, case] = _run(plain_label, case, world_size,
                                                base / plain_label / case)
            expected = plain[plain_label, case]
            got = _run(label, case, world_size, base / label / case)
            out[f"{label} | {case}"] = Comparison(
                compare(expected["values"], got["values"]).differences
                + compare(expected["recorded"], got["recorded"]).differences)
    if world_size == 1:
        out["one device | a backward by hand after the fit"] = _backward_after_fit(base)
    return out


def _backward_after_fit(root: Path) -> dict[str, Any]:
    """The fit released its optimizer: a backward by hand afterwards is a plain one
    (accumulates gradients, steps nothing)."""
    from overlapkit.integrations.lightning import OverlapSingleDeviceStrategy

    module = Regression()
    trainer(OverlapSingleDeviceStrategy(), 1, root / "after", max_steps=2).fit(module, data())
    trained = values(module)
    x, y = next(iter(data()))
    module.zero_grad()
    error = error_of(lambda: torch.nn.functional.mse_loss(module.net(x), y).backward())
    return {"error": error, "unchanged": compare(trained, values(module)),
            "grads": all(p.grad is not None for p in module.parameters())}
