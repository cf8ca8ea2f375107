"""Rank code of tests/trainers/test_lightning_swa.py: ``StochasticWeightAveraging`` on a
module with BatchNorm, whose extra last epoch (forwards only, no backward, no
``zero_grad``) ends with an optimizer step that steps the last training step's gradients
again; against the plain strategy's fit: the parameters, the BatchNorm buffers and
AdamW's state, bitwise, and the warnings."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from helpers import compare
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging
from lightning_models import Regression, data, quiet, trainer, values
from lightning_parity_ranks import strategy
from torch import nn

PAIRS = {1: {"overlap_ddp": "ddp", "optimizer_in_backward": "ddp",
             "one device": "single device"},
         2: {"overlap_ddp": "ddp", "optimizer_in_backward": "ddp"}}


class WithBatchNorm(Regression):
    """A linear layer, BatchNorm, GELU, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU(),
                                 nn.Linear(32, 1))
        #: (epoch, batch) of the training steps that found the gradients of the step
        #: before freed (optimizer_in_backward stepped it during its backward)
        self.freed: list[tuple[int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if all(p.grad is None for p in self.parameters()):
            self.freed.append((self.current_epoch, batch_idx))
        return super().training_step(batch, batch_idx)


def _fit(label: str, world_size: int, root: Path, options: dict[str, Any],
         freed: dict[str, Any] | None = None) -> list[torch.Tensor]:
    module = WithBatchNorm()
    trainer(strategy(label), world_size, root, max_epochs=2,
            callbacks=[StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)],
            **options).fit(module, data())
    if freed is not None:
        freed[label] = module.freed
    saved = module.optimizers().state_dict()  # type: ignore[union-attr]
    return [*values(module), *[b.clone() for b in module.buffers()],
            *[v for i in sorted(saved["state"]) for v in saved["state"][i].values()]]


def run(rank: int, world_size: int, root: str, options: dict[str, Any] | None = None
        ) -> dict[str, Any]:
    """``options``: more of the Trainer's (accumulation, clipping, fewer batches)."""
    quiet()
    options = options or {}
    plain = {p: _fit(p, world_size, Path(root) / p, options)
             for p in set(PAIRS[world_size].values())}
    out: dict[str, Any] = {}
    freed: dict[str, Any] = {}
    for label, plain_label in PAIRS[world_size].items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got = _fit(label, world_size, Path(root) / label, options, freed)
            except Exception as error:  # reported, not raised: every rank answers
                out[label] = f"{type(error).__name__}: {error}"
                continue
        out[label] = bool(compare(plain[plain_label], got))
        out[f"{label} | warnings"] = [str(w.message) for w in caught
                                      if "in the plain order" in str(w.message)]
        out[f"{label} | freed"] = freed.get(label)
    return out


def _resumed(label: str, world_size: int, root: Path, ckpt: str) -> list[torch.Tensor]:
    module = WithBatchNorm()
    trainer(strategy(label), world_size, root, max_epochs=2,
            callbacks=[StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)]
            ).fit(module, data(), ckpt_path=ckpt)
    saved = module.optimizers().state_dict()  # type: ignore[union-attr]
    return [*values(module), *[b.clone() for b in module.buffers()],
            *[v for i in sorted(saved["state"]) for v in saved["state"][i].values()]]


def resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A plain fit saves a checkpoint at the end of each epoch; each strategy resumes from
    the one of the last training epoch, so the fit is the BatchNorm epoch alone, whose
    step (the fit's first) has no gradients to step, in the plain run too."""
    quiet()
    saving = WithBatchNorm()
    trainer(strategy("ddp"), world_size, Path(root) / "saving", max_epochs=2,
            enable_checkpointing=True,
            callbacks=[StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1),
                       ModelCheckpoint(dirpath=str(Path(root) / "saved"), save_top_k=-1,
                                       every_n_epochs=1, save_on_train_epoch_end=True)]
            ).fit(saving, data())
    ckpt = str(next((Path(root) / "saved").glob("epoch=1-*.ckpt")))
    plain = {p: _resumed(p, world_size, Path(root) / p, ckpt)
             for p in set(PAIRS[world_size].values())}
    out: dict[str, Any] = {}
    for label, plain_label in PAIRS[world_size].items():
        try:
            got = _resumed(label, world_size, Path(root) / label, ckpt)
        except Exception as error:  # reported, not raised: every rank answers
            out[label] = f"{type(error).__name__}: {error}"
            continue
        out[label] = bool(compare(plain[plain_label], got))
    return out
