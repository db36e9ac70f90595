"""A value split into random pieces that sum to it: how a partial-sum input is made.

A partial value must come from real per-rank contributions: zeros on all ranks but one, or
equal shares, would let an op that is not linear in the value pass by coincidence (``relu``
of a zero piece is zero; ``x * x`` of equal shares scales alike everywhere). Every piece here
is the value's share plus noise of the share's own magnitude, and the noise sums to zero, so
every piece differs from the value, from its share and from the others.
"""

from __future__ import annotations

import torch

__all__ = ["partial_pieces"]


def partial_pieces(value: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """``count`` pieces of ``value`` (stacked on a new dim 0, in float64) that sum to it; the
    same ``seed`` and value give the same pieces in every process, so each rank of a group
    can make all of them and keep its own."""
    generator = torch.Generator().manual_seed(seed)
    full = value.detach().to(torch.float64)
    finite = torch.isfinite(full)
    noise = torch.randn((count, *full.shape), generator=generator, dtype=torch.float64).to(full.device)
    # noise of one share's magnitude: each piece differs from its share by about the share,
    # yet the pieces do not cancel by much more than the value itself (rounding stays an op's)
    scale = float(full[finite].abs().mean()) / count if finite.any() else 0.0
    noise = (noise - noise.mean(dim=0, keepdim=True)) * (scale if scale > 0 else 1.0)
    pieces = noise + torch.where(finite, full, 0.0) / count
    # an inf or NaN is no sum of finite pieces: the first piece holds it, the others their noise
    pieces[0] = torch.where(finite, pieces[0], full)
    return pieces
