"""A user's model for pipeline tests (``[model] factory`` / ``--model-factory``): a small byte
MLP as an ``nn.Sequential``, the contract of ``swarmtrain.pipeline.model``. Child processes
import it as ``tests.pipeline_user_model`` with the repository root on PYTHONPATH."""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 32


class Residual(nn.Module):
    """x + MLP(LayerNorm(x)): one hidden layer, so the model learns more than bigrams' bias."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def build() -> nn.Sequential:
    """Byte ids (B, T) -> (B, T, 256) logits of the next byte (from the current byte alone)."""
    return nn.Sequential(
        nn.Embedding(256, WIDTH),
        Residual(WIDTH),
        Residual(WIDTH),
        nn.LayerNorm(WIDTH),
        nn.Linear(WIDTH, 256),
    )


class Layered(nn.Module):
    """Not a Sequential, but exposes its ordered ``layers``: the other accepted shape."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(256, 8), nn.Linear(8, 256)])


def build_layered() -> Layered:
    return Layered()


def build_wrong_output() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 10))


def build_not_layers() -> int:
    return 3


def build_raises() -> nn.Module:
    """A factory that fails itself, with a message of two lines (a traceback's shape)."""
    raise RuntimeError("weights.bin is missing\n  (looked in /nowhere)")


class Cumulative(nn.Module):
    """A running log-sum-exp over the sequence: ``torch.logcumsumexp``, which RepOps has no
    reproducible mapping for (a verified run refuses it at spec time, naming it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.logcumsumexp(x, dim=1)


def build_cumulative() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(256, WIDTH), Cumulative(), nn.Linear(WIDTH, 256))
