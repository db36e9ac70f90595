"""How a dim is cut into blocks, DTensor's way, and what that allows.

A dim of size n split k ways gives blocks of ceil(n/k) from the start, the last ones smaller
or empty, as ``torch.chunk`` and DTensor's ``Shard`` cut it; a dim split over several mesh
axes is split over the first axis, then each block over the next. Two facts follow that a
generator must respect, kept here once:

* a compound dim (a flatten of ``(a b)``) cut through ``a`` unevenly is not the layout of the
  flat dim (3 x 2 over 2 ranks: rows 0-3 and 4-5, where the flat dim's blocks are 0-2, 3-5);
* a partial value is reduced by one op over the group: a partial average over blocks of
  unequal size is not the average of the whole, and an empty block has no max or min.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["chunk_block", "nested_block", "block_lengths", "partial_refusal"]


def chunk_block(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of block ``index`` of a dim of ``size`` split ``parts`` ways: blocks of
    ceil(size/parts) from the start (7 over 4: 2, 2, 2, 1; 5 over 4: 2, 2, 1, 0)."""
    full = -(-size // parts)
    start = min(full * index, size)
    return start, min(size, start + full) - start


def nested_block(size: int, splits: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(start, length) of the block reached by splitting a dim of ``size`` by each
    ``(parts, index)`` in turn: the first split is over the first mesh axis of ``S<axes>``."""
    start, length = 0, size
    for parts, index in splits:
        offset, length = chunk_block(length, parts, index)
        start += offset
    return start, length


def block_lengths(size: int, parts: Sequence[int]) -> list[int]:
    """Every block's length, in group order (the first split most significant)."""
    return [nested_block(size, list(zip(parts, index)))[1]
            for index in itertools.product(*(range(p) for p in parts))]


def partial_refusal(op: str, size: int, parts: Sequence[int]) -> str | None:
    """Why a value reduced by ``op`` over a dim of ``size`` cut into ``parts`` cannot be left
    partial (each rank reducing its own block, the group combining them), or None when it can."""
    lengths = block_lengths(size, parts)
    if op == "avg" and len(set(lengths)) > 1:
        return (f"a partial avg over blocks of unequal size ({', '.join(map(str, lengths))} of {size}) "
                f"is not the average of the whole")
    if op in ("max", "min") and 0 in lengths:
        return f"an empty block (of {size} cut {'x'.join(map(str, parts))} ways) has no {op}"
    return None
