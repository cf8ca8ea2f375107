"""The demo's model and synthetic data: an MLP regressing a fixed random teacher.

Every rank builds the same model from the same seed and its own data from
``seed + rank``, so runs are reproducible and techniques are compared on exactly the
same numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from overlapkit.cli.demo.config import ModelSize

__all__ = ["build_model", "make_batches"]


def build_model(size: ModelSize, seed: int) -> nn.Module:
    """The MLP, initialised from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(size.features, size.hidden), nn.GELU()]
    for _ in range(size.layers - 1):
        layers += [nn.Linear(size.hidden, size.hidden), nn.GELU()]
    layers.append(nn.Linear(size.hidden, size.features))
    return nn.Sequential(*layers)


def make_batches(
    size: ModelSize, steps: int, seed: int, rank: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of (input, target) for ``rank``, made as they are needed:
    targets from a fixed random teacher."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(size.features, size.features, generator=generator) / size.features**0.5
    generator.manual_seed(seed + 1 + rank)
    for _ in range(steps):
        x = torch.randn(size.batch, size.features, generator=generator)
        yield x, torch.tanh(x @ teacher)
