"""The LightningModules and Trainer set-up the Lightning tests share: a small regression
model whose ``configure_optimizers`` returns plain AdamW with the usual decay/no-decay
groups (weights first: Lightning clips in that order, not the model's) and a per-step
LR schedule that changes the LR when it is built (LinearLR warm-up)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: samples in the data set (4 batches of 4 per rank and epoch on 2 ranks)
SAMPLES = 32


def quiet() -> None:
    """Lightning's tips, its warnings about few dataloader workers, and the like."""
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def data() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 16, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=4)


class Regression(L.LightningModule):
    """Three linear layers, AdamW in two groups, a LinearLR warm-up stepped per step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                                 nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        weights = [p for n, p in self.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in self.named_parameters() if n.endswith("bias")]
        optimizer = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1},
                                       {"params": biases, "weight_decay": 0.0}], lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25,
                                                      total_iters=4)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LogsGradNorms(Regression):
    """Logs gradient norms in ``on_before_optimizer_step``, as Lightning's docs show."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norms = grad_norm(self, norm_type=2)
        self.norms.append({k: v.clone() for k, v in norms.items()})
        self.log_dict(norms)


def trainer(strategy: Any, devices: int, root: Path, accelerator: str = "cpu",
            **options: Any) -> L.Trainer:
    """A quiet Trainer: no logger, checkpoint callback, progress bar or summary."""
    settings: dict[str, Any] = {"max_epochs": 2, "logger": False,
                                "enable_checkpointing": False, "enable_progress_bar": False,
                                "enable_model_summary": False, "default_root_dir": str(root)}
    settings.update(options)
    return L.Trainer(strategy=strategy, devices=devices, accelerator=accelerator, **settings)


def values(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in module.parameters()]
