"""What each rank holds of a case's inputs under a strategy: its block of the reference in the
check's dtype, or of a partial input its piece of that block, each made once per case and layout
and shared by every strategy laying the input out alike (read only: callers copy)."""

from __future__ import annotations

import math
import threading

import torch

from shardverify.sharding.pieces import partial_pieces
from shardverify.sharding.strategy import ShardingStrategy
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.verify.layout import LocalOperand, stacked_shards
from shardverify.verify.memo import case_table, recalled, remembered
from shardverify.verify.reference import Reference

__all__ = ["rank_blocks", "stacked_pieces", "extremum_holder"]


def rank_blocks(ref: Reference, strategy: ShardingStrategy, operands: list[LocalOperand], position: int, mesh,
                ranks: list[int], copies: bool = True) -> list[torch.Tensor]:
    """Each of ``ranks``' own copy of what it holds of input ``position``, ``ranks[i]`` laying it
    out as ``operands[i]``: its block of the reference in the check's dtype, or of a partial
    input its piece of that block (:func:`_shared_piece`).  ``copies`` False: the shared blocks
    themselves (read only), for a caller that copies them all at once."""
    data = operands[0].data
    loc = (data.locator.kind, data.locator.key)
    partial = strategy.partial_input(data.name)
    if partial is None:
        typed, blocks = ref.typed(loc), []
        for operand, rank in zip(operands, ranks):
            view = recalled(_BLOCKS, (id(typed), operand.spec.key, rank), typed)
            view = _block(typed, operand, mesh, rank) if view is None else view
            blocks.append(view.clone() if copies else view)
        return blocks
    full, dtype = ref.values[loc], ref.dtypes[loc]
    return [_shared_piece(full, operand, mesh, rank, partial.axes, position, partial.op).to(dtype, copy=copies)
            for operand, rank in zip(operands, ranks)]


def stacked_pieces(ref: Reference, operand: LocalOperand, position: int, mesh, axes: tuple[int, ...],
                   op: str) -> torch.Tensor | None:
    """Every rank's piece of its block of partial input ``position`` (what :func:`rank_blocks`
    gives each rank), stacked in rank order in the check's dtype, for a layout whose blocks are
    all of one shape: the whole tensor's pieces laid out with their count split over the partial
    ``axes`` (a rank keeps the piece at its position in its group).  None where the whole's pieces
    are not made (a complex or too large tensor: each block makes its own)."""
    data = operand.data
    loc = (data.locator.kind, data.locator.key)
    full = ref.values[loc]
    whole = _whole_pieces(full, math.prod(mesh.shape[a] for a in axes), position, op)
    if whole is None or any(a in held for _, held in operand.spec.dim_partition for a in axes):
        return None
    key = (tuple(mesh.shape), tuple(whole.shape), axes, operand.spec.dim_partition)
    spec = _PIECE_SPECS.get(key)
    if spec is None:
        if len(_PIECE_SPECS) >= 1024:
            _PIECE_SPECS.clear()
        spec = _PIECE_SPECS[key] = ShardingSpec(tuple(mesh.shape), tuple(whole.shape), ((0, axes),) + tuple(
            (dim + 1, held) for dim, held in operand.spec.dim_partition))
    return stacked_shards(whole, spec).squeeze(1).to(ref.dtypes[loc])


#: (mesh shape, pieces' shape, partial axes, the block's partition) -> the layout of the whole's pieces
_PIECE_SPECS: dict = {}
_BLOCKS: dict = case_table()


def _block(tensor: torch.Tensor, operand: LocalOperand, mesh, rank: int) -> torch.Tensor:
    """``operand.shard(tensor, mesh, rank)``, remembered per (tensor, layout, rank): the strategies
    of a case laying an input out alike take their blocks from one view (read only: callers
    copy), as the bare op of ``benchmarks/bench_verify.py`` slices its shards once."""
    return remembered(_BLOCKS, (id(tensor), operand.spec.key, rank), tensor, lambda: operand.shard(tensor, mesh, rank),
                      limit=8192)


_PIECES: dict = case_table()


def _shared_piece(full: torch.Tensor, operand: LocalOperand, mesh, rank: int, axes: tuple[int, ...], seed: int,
                  op: str) -> torch.Tensor:
    """This rank's piece of its block of the reference tensor ``full`` held as a partial value
    over mesh ``axes`` (the pieces reduce by ``op``; every rank of the group makes the same
    pieces from the same block and seed and keeps the one at its position), read only: callers
    copy.  The pieces of a real tensor are made once per (tensor, count, seed, op) for the whole
    tensor and each block takes its slice of them (:func:`_whole_pieces`); a complex or too
    large tensor's once per (tensor, block, mesh, axes, seed, op), shared by every rank of the
    group and every strategy of the case laying the tensor out alike."""
    count = math.prod(mesh.shape[a] for a in axes)
    whole = _whole_pieces(full, count, seed, op)
    if whole is not None:
        return whole[(mesh.group_index(rank, axes), *operand.slices)]
    block = tuple((s.start, s.stop, s.step) for s in operand.slices)
    pieces = recalled(_PIECES, (id(full), block, tuple(mesh.shape), axes, seed, op), full)
    if pieces is None:
        pieces = remembered(_PIECES, (id(full), block, tuple(mesh.shape), axes, seed, op), full,
                            lambda: partial_pieces(operand.shard(full, mesh, rank), count, seed, op), limit=1024)
    return pieces[mesh.group_index(rank, axes)]


#: elements of a whole tensor's pieces made at once at most (float64: 128 MiB, half of what the table keeps, so
#: a tensor's pieces over one mesh axis and over two fit together: at the whole budget they evicted each other at
#: every layout); a larger one's blocks make their own. The blocks of a layout's partial input are as large
#: together as the whole, and a case's layouts cut it into several: the whole's pieces take less time and memory
_WHOLE_MOST = 1 << 24
#: bytes of whole tensors' pieces kept at most (the table is emptied before it would hold more)
_WHOLE_BYTES = 1 << 28
_WHOLE_PIECES: dict = case_table()
_WHOLE_LOCK = threading.Lock()


def _whole_bytes() -> int:
    """Bytes of the whole tensors' pieces kept: one case's at most (a case table), a few entries."""
    return sum(pieces.nbytes for _, pieces in _WHOLE_PIECES.values())


def _whole_pieces(full: torch.Tensor, count: int, seed: int, op: str = "sum") -> torch.Tensor | None:
    """``partial_pieces(full, count, seed, op)`` of a real tensor, made once per (tensor, count,
    seed, op), or None for a complex or too large one.  Pieces are elementwise in the value and
    their draws but for a scale or two of the whole tensor (a sum's share of its mean magnitude;
    a max's or min's gaps, a tenth of its mean magnitude and more than its spread), so a block's
    pieces are the block's slice of the whole's: the layouts of a case, which cut the same tensor
    into many blocks, make its pieces once, not once per block."""
    if full.is_complex() or full.numel() * count > _WHOLE_MOST:
        return None
    key = (id(full), count, seed, op)
    found = recalled(_WHOLE_PIECES, key, full)
    if found is None:
        with _WHOLE_LOCK:   # rank threads ask at once: one makes them, and the table is summed unchanged
            found = recalled(_WHOLE_PIECES, key, full)
            if found is None:
                found = partial_pieces(full, count, seed, op)
                _WHOLE_PIECES.pop(key, None)   # another tensor's, which had the same id
                if _whole_bytes() + found.nbytes > _WHOLE_BYTES:
                    _WHOLE_PIECES.clear()
                _WHOLE_PIECES[key] = (full, found)   # as memo.remembered keeps it: the owner with its value
    return found


def extremum_holder(strategy: ShardingStrategy, ref: Reference, operand, position: int, mesh,
                     rank: int) -> torch.Tensor | None:
    """Where this rank's piece of a partial max/min input is the value itself (the elements
    whose gradient it receives), or None for any other input."""
    data = operand.data
    partial = strategy.partial_input(data.name)
    if partial is None or partial.op == "sum":
        return None
    full = ref.values[(data.locator.kind, data.locator.key)]
    return remembered(_HOLDERS, (id(full), operand.spec.key, rank, partial.axes, position, partial.op), full,
                      lambda: _shared_piece(full, operand, mesh, rank, partial.axes, position, partial.op) ==
                      operand.shard(full, mesh, rank).to(torch.float64), limit=8192)


#: (tensor, layout, rank, partial axes, seed, op) -> where the rank's piece is the value: every strategy of a case
#: laying the input out alike asks for the same (read only)
_HOLDERS: dict = case_table()
