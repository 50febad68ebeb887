"""Small models and deterministic synthetic data for scenarios, tests and benchmarks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def reference_mlp(seed: int = 0, d_in: int = 512, width: int = 1024, n_out: int = 10) -> nn.Module:
    """The benchmarks' reference model: an MLP of about 1.6M parameters."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, n_out)
    )


def classification_batch(
    rank: int, step: int, *, batch: int, d_in: int, n_out: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch for (rank, step): the same inputs in every process and run."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 65_537 + rank)
    x = torch.randn(batch, d_in, generator=g)
    y = torch.randint(0, n_out, (batch,), generator=g)
    return x, y


def cross_entropy_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)
