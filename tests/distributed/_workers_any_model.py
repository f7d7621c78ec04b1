"""Importable pieces for tests/distributed/test_any_model.py: a model factory and a callable batch
source, which a launch pickles by reference (what a researcher's own module would hold)."""

from __future__ import annotations

import torch
import torch.nn as nn

ROWS, FEATURES, CLASSES = 512, 16, 4


def dataset(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and a class the model can learn from them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, FEATURES, generator=gen)
    return x, (x[:, :CLASSES] * torch.tensor([1.0, -2.0, 0.5, 1.5])).argmax(1)


def build_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: 16 consecutive rows of the dataset."""
    x, y = dataset()
    start = (step * 16) % ROWS
    return x[start:start + 16], y[start:start + 16]
