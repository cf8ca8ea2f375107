"""Rank code of tests/trainers/test_lightning_by_hand.py: a fit whose backward runs
outside ``optimizer.step(closure=...)`` for a reason other than an ``optimizer_step``
override (manual optimization switched on in ``on_train_start``; a wrapper set on
``self.optimizers().step`` that runs the closure itself), against the plain strategy's
fit of the same module: the parameters and optimizer state, bitwise, and the one
warning's text; or the refusal, with the parameters it left."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from helpers import compare, error_of
from lightning_models import Regression, data, quiet, trainer, values
from lightning_parity_ranks import strategy


class ManualFromTrainStart(Regression):
    """Switches to manual optimization in ``on_train_start`` (set before the fit, it is
    refused at set-up): ``manual_backward``, ``clip_gradients`` and ``opt.step()``."""

    def on_train_start(self) -> None:
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        optimizer: Any = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()
        return None


class WrapsOptimizersStep(Regression):
    """Sets a ``step`` on ``self.optimizers()`` in ``on_train_start`` that runs the
    closure, then the saved step without it."""

    def on_train_start(self) -> None:
        optimizer: Any = self.optimizers()
        saved = optimizer.step

        def step(closure: Any = None, **kwargs: Any) -> Any:
            closure()
            return saved(**kwargs)

        optimizer.step = step


MODULES = {"manual optimization from on_train_start": ManualFromTrainStart,
           "a wrapper on self.optimizers().step": WrapsOptimizersStep}
#: overlapkit's strategy -> the plain one, by world size
PAIRS = {1: {"overlap_ddp": "ddp", "optimizer_in_backward": "ddp",
             "one device": "single device"},
         2: {"overlap_ddp": "ddp", "optimizer_in_backward": "ddp"}}


def _state(fitted: Any) -> list[torch.Tensor]:
    module, optimizer = fitted
    return values(module) + [v for s in optimizer.state.values() for v in s.values()]


def _fit(case: str, label: str, world_size: int, root: Path) -> Any:
    module = MODULES[case]()
    fit = trainer(strategy(label), world_size, root, max_epochs=1)
    fit.fit(module, data())
    optimizer = fit.optimizers[0]
    return module, getattr(optimizer, "optimizer", optimizer)


def _refused(case: str, label: str, world_size: int, root: Path) -> dict[str, Any]:
    """What the fit raised, and whether the parameters moved before it did."""
    module = MODULES[case]()
    before = values(module)
    fit = trainer(strategy(label), world_size, root, max_epochs=1)
    return {"error": error_of(lambda: fit.fit(module, data())),
            "moved": not compare(before, values(module))}


def run(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Each case with each strategy: the comparison with the plain fit and the warnings
    about the plain order; or the refusal and how far the parameters moved."""
    quiet()
    out: dict[str, Any] = {}
    for case in MODULES:
        plain = {p: _state(_fit(case, p, world_size, Path(root) / case / p))
                 for p in set(PAIRS[world_size].values())}
        for label, plain_label in PAIRS[world_size].items():
            where = Path(root) / case / label
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if case.startswith("manual") and label == "optimizer_in_backward":
                    out[f"{label} | {case}"] = _refused(case, label, world_size, where)
                else:
                    got = _state(_fit(case, label, world_size, where))
                    out[f"{label} | {case}"] = bool(compare(plain[plain_label], got))
            out[f"{label} | {case} | warnings"] = [
                str(w.message) for w in caught if "in the plain order" in str(w.message)]
    return out
