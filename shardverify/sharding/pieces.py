"""A value split into random pieces that sum to it (or whose max or min it is): how a
partial input is made.

A partial value must come from real per-rank contributions: zeros on all ranks but one, or
equal shares, would let an op that is not linear in the value pass by coincidence (``relu``
of a zero piece is zero; ``x * x`` of equal shares scales alike everywhere). Every piece here
is the value's share plus noise that sums to zero, so every piece differs from the value, from
its share and from the others. The noise's largest piece at an element is the element's own
magnitude plus a share of the tensor's: at every element some piece has the value's sign and
some the other sign, so a map that keeps only a sign (``x / 0``: inf or -inf, NaN once summed)
shows a wrong partial-sum rule at every such element, not at those where the draw happened to
mix the signs.

A partial max gives each element to one rank picked at random, which holds the value itself;
every other rank holds the value less a random gap of the value's own magnitude (a partial min:
more), so no two pieces tie and the holder is known: the rank whose piece equals the value.
"""

from __future__ import annotations

import torch

__all__ = ["partial_pieces"]


def piece_draws(count: int, shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """The standard normal draws of ``count`` pieces of a value of ``shape`` (float64), the same
    for the same seed in every process: drawn in float32, whose kernel is several times faster
    than float64's, the noise needing no more digits."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((count, *shape), generator=generator, dtype=torch.float32).to(device=device, dtype=torch.float64)


def unit_noise(draws: torch.Tensor) -> torch.Tensor:
    """Standard normal ``draws`` of shape ``(count, *shape)`` made into the pieces' noise: centred
    on zero over the pieces at each element, its largest piece there of size 1 (a new tensor).
    Elementwise along the pieces, so a block's slice of a whole tensor's unit noise is the unit
    noise of the block's slice of its draws: a tensor's is made once for all its blocks."""
    noise = draws - draws.mean(dim=0, keepdim=True)
    return noise.div_(noise.abs().amax(dim=0).clamp_min_(torch.finfo(torch.float64).tiny))


def partial_pieces(value: torch.Tensor, count: int, seed: int, op: str = "sum") -> torch.Tensor:
    """``count`` pieces of ``value`` (stacked on a new dim 0, in float64 or complex128) that reduce to it by
    ``op`` (sum, max or min); the same ``seed`` and value give the same pieces in every process,
    so each rank of a group can make all of them and keep its own.  Pieces of a real value are
    elementwise in the value and its draws but for a scale or two of the whole value (a sum's
    share of its mean magnitude; a max's or min's gaps, from its mean magnitude and its spread),
    so the pieces of a whole tensor, sliced, are pieces of each of its blocks."""
    if value.is_complex():   # pieces of its real and imaginary parts (no max or min of complex numbers)
        if op != "sum":
            raise ValueError(f"a complex value's partial pieces combine by sum, not {op!r}")
        real = torch.view_as_real(value.detach().to(torch.complex128))
        return torch.view_as_complex(partial_pieces(real, count, seed, op).contiguous())
    if op in ("max", "min"):
        return _extremum_pieces(value, count, seed, op)
    if op != "sum":
        raise ValueError(f"partial pieces combine by sum, max or min, not {op!r}")
    full = value.detach().to(torch.float64)
    finite = torch.isfinite(full)
    unit = unit_noise(piece_draws(count, tuple(full.shape), seed, full.device))
    every = bool(finite.all())
    if every:   # the same elements in the same order as the mask's, without the mask's copy
        scale = float(full.reshape(-1).abs().mean()) / count if full.numel() else 0.0
    else:
        scale = float(full[finite].abs().mean()) / count if finite.any() else 0.0
    share = full / count if every else torch.where(finite, full, 0.0) / count
    # the noise at each element, its largest piece scaled to the element's magnitude plus a share:
    # then some piece has the other sign than the value (with count pieces, the other side's
    # noise totals at least that largest one), yet the pieces cancel by not much more than the
    # value itself (rounding stays an op's)
    noise = unit.mul_(share.abs().mul_(count).add_(scale if scale > 0 else 1.0))
    if every:
        return noise.add_(share)
    pieces = noise + share
    # an inf or NaN is no sum of finite pieces: the first piece holds it, the others their noise
    pieces[0] = torch.where(finite, pieces[0], full)
    return pieces


def _extremum_pieces(value: torch.Tensor, count: int, seed: int, op: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    full = value.detach().to(torch.float64)
    finite = torch.isfinite(full)
    scale = float(full[finite].abs().mean()) if finite.any() else 1.0
    holder = torch.randint(count, full.shape, generator=generator).to(full.device)
    # gaps of at least a tenth of the magnitude: no piece comes near a tie in float32. Half of them
    # near (an op that is not monotone shows it close to the value) and half wider than the value's
    # whole spread, past every element of it: a reduction over the elements is no elementwise map
    # (the max of a partial min is no partial min) and shows it where a piece's far element wins
    spread = float(full[finite].max() - full[finite].min()) if finite.any() else 0.0
    gaps = (torch.rand((count, *full.shape), generator=generator, dtype=torch.float64).to(full.device) + 0.1) * \
        (scale if scale > 0 else 1.0)
    far = torch.rand((count, *full.shape), generator=generator, dtype=torch.float64).to(full.device) < 0.5
    gaps = gaps + far * spread
    held = torch.arange(count, device=full.device).reshape(-1, *([1] * full.dim())) == holder
    pieces = full - gaps if op == "max" else full + gaps
    return torch.where(held | ~finite, full, pieces)
