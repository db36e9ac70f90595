"""Model factories for specs whose model is not a plain stack of layers.

A spec names one as `factory: shardverify.features.ddp.zoo:<function>`; keyword arguments come from
`factory_kwargs`. Keep them tiny: every check trains them on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["UnusedBranchNet", "unused_branch_model"]


class UnusedBranchNet(nn.Module):
    """Linear + ReLU + Linear with a third Linear that forward never calls.

    Its parameters never receive a gradient, so DDP must be told `find_unused_parameters=True`
    (or `static_graph=True`), otherwise the reducer waits for them forever."""

    def __init__(self, in_features: int, hidden: int, out_features: int) -> None:
        super().__init__()
        self.trunk = nn.Linear(in_features, hidden)
        self.head = nn.Linear(hidden, out_features)
        self.unused = nn.Linear(hidden, out_features)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.trunk(inputs)))


def unused_branch_model(in_features: int = 6, hidden: int = 8, out_features: int = 3) -> nn.Module:
    return UnusedBranchNet(in_features, hidden, out_features)
