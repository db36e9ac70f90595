"""Indices into a sharded dim: what vocab-parallel embedding does on every rank.

An integer operand may hold positions along a dim of another operand (embedding's ids into
the weight's vocab rows, an index_select's index). When a strategy shards that dim, each rank
holds rows ``[start, start + size)`` only: it shifts the ids into its shard, looks the ids it
does not hold up at row 0 and zeroes their output, so the ranks' outputs add up to the real
one (a partial sum, all-reduced by the strategy's declared AFTER action). The verifier, the
plan executor and the audit all run these two steps, so the arithmetic lives here once.
"""

from __future__ import annotations

import torch

__all__ = ["shift_into_shard", "zero_outside_shard"]


def shift_into_shard(index: torch.Tensor, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the ids relative to the shard, out-of-shard ids replaced by 0; the mask of those ids)."""
    local = index - start
    outside = (local < 0) | (local >= size)
    return local.masked_fill(outside, 0), outside


def zero_outside_shard(output: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
    """``output`` with the entries of out-of-shard ids zeroed (differentiably: their gradient
    reaches no row). The output's leading dims are the index's; the rest broadcast."""
    mask = outside.reshape(tuple(outside.shape) + (1,) * (output.dim() - outside.dim()))
    return output.masked_fill(mask, 0)
