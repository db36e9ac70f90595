"""Small models the shipped plan specs use (factories named by dotted path in specs/plans)."""

from __future__ import annotations

import torch
from torch import nn


class LinearChain(nn.Module):
    """Linear-Linear: a two-layer MLP without an activation (handlers for linear only)."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


class MLPBlock(nn.Module):
    """Linear-GELU-Linear."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_in, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def linear_chain(d_in: int = 32, d_hidden: int = 64, d_out: int = 32) -> nn.Module:
    return LinearChain(d_in, d_hidden, d_out)


def mlp_block(d_in: int = 32, d_hidden: int = 64) -> nn.Module:
    return MLPBlock(d_in, d_hidden)
