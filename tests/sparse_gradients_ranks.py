"""The rank side of tests/test_sparse_gradients_ddp.py: a DDP model with an
``nn.Embedding(sparse=True)``, each technique refused at set-up; the model then trained
by a plain SGD loop, compared with a model never handed to overlapkit."""

from __future__ import annotations

from typing import Any

import torch
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


class SparseEmbedding(nn.Module):
    """A sparse embedding of indices made from the batch, then a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(50, 16, sparse=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        indices = (x.abs() * 10).long().clamp(0, 49)[:, :4]
        return self.head(self.embedding(indices).mean(1))


def _plain_steps(rank: int, model: nn.Module, ddp: DDP) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for batch in rank_batches(rank, 3):
        ddp(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return values(model)


def run(rank: int, world_size: int) -> dict[str, Any]:
    """Each technique's refusal, and the plain loop on the refused model."""
    reference = SparseEmbedding()
    expected = _plain_steps(rank, reference, DDP(reference))
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        model = SparseEmbedding()
        ddp = DDP(model)
        error = error_of(lambda ddp=ddp, technique=technique: getattr(overlapkit, technique)(
            ddp, torch.optim.SGD, lr=0.1, momentum=0.9))
        out[technique] = {"error": error,
                          "plain after": compare(expected, _plain_steps(rank, model, ddp))}
    return out
