"""Collectives over blocks of unequal length: what resharding a dim cut DTensor's way needs.

A dim of 7 over 3 ranks is held as blocks of 3, 3 and 1 (:mod:`shardverify.sharding.blocks`).
The raw collectives exchange tensors of one shape, so each function here pads every block with
zeros to the longest one, runs one collective, and trims what it receives to the sender's real
length (DTensor pads and unpads the same way for its uneven ``Shard``). The caller passes the
lengths (every member's, in group order, computed from the layout: no exchange of sizes). Each
is an ``autograd.Function`` whose backward is the adjoint of its forward, under the same
conventions as :mod:`shardverify.collectives.patterns`:

==========================  ==========================  =================================
function                    forward                     backward
==========================  ==========================  =================================
``gather``                  all-gather, padded          keep own block (the gathered
                                                        value is replicated)
``split``                   keep own block              all-gather, padded
``reduce_scatter``          reduce-scatter, padded      all-gather, padded
``all_to_all``              all-to-all, padded on       the reverse all-to-all
                            both dims
==========================  ==========================  =================================
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from shardverify.collectives.functional import group_position

__all__ = ["gather", "split", "reduce_scatter", "all_to_all"]


def _pad(t: Tensor, dim: int, length: int) -> Tensor:
    """``t`` with zeros appended along ``dim`` up to ``length``."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim)


def _starts(lengths: Sequence[int]) -> list[int]:
    found, at = [], 0
    for n in lengths:
        found.append(at)
        at += n
    return found


def _gather(comm, t: Tensor, axes, dim: int, lengths: Sequence[int]) -> Tensor:
    parts = comm.all_gather(_pad(t, dim, max(lengths)).contiguous(), axes)
    return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, lengths)], dim)


def _own(comm, t: Tensor, axes, dim: int, lengths: Sequence[int]) -> Tensor:
    position = group_position(comm, axes)
    return t.narrow(dim, _starts(lengths)[position], lengths[position]).contiguous()


def _reduce_scatter(comm, t: Tensor, axes, dim: int, lengths: Sequence[int]) -> Tensor:
    longest = max(lengths)
    chunks = [_pad(t.narrow(dim, start, n), dim, longest).contiguous() for start, n in zip(_starts(lengths), lengths)]
    out = comm.reduce_scatter(chunks, axes, "sum")
    return out.narrow(dim, 0, lengths[group_position(comm, axes)]).contiguous()


def _all_to_all(comm, t: Tensor, axes, split_dim: int, split_lengths: Sequence[int], concat_dim: int,
                concat_lengths: Sequence[int]) -> Tensor:
    """Chunk j of ``split_dim`` (``split_lengths[j]`` long, the same cut on every member) goes to
    member j; member j's piece arrives ``concat_lengths[j]`` long along ``concat_dim``."""
    padded = _pad(t, concat_dim, max(concat_lengths))
    longest = max(split_lengths)
    chunks = [_pad(padded.narrow(split_dim, start, n), split_dim, longest).contiguous()
              for start, n in zip(_starts(split_lengths), split_lengths)]
    mine = split_lengths[group_position(comm, axes)]
    got = comm.all_to_all(chunks, axes)
    return torch.cat([piece.narrow(split_dim, 0, mine).narrow(concat_dim, 0, n)
                      for piece, n in zip(got, concat_lengths)], concat_dim)


class _Blocks(torch.autograd.Function):
    """One padded exchange of the blocks of ``dim`` forward (``forward``), its adjoint backward."""

    @staticmethod
    def forward(ctx, t, comm, axes, dim, lengths, forward, backward):
        ctx.args, ctx.adjoint = (axes, dim, lengths), backward
        ctx.comm = comm
        return forward(comm, t, axes, dim, lengths)

    @staticmethod
    def backward(ctx, grad):
        return (ctx.adjoint(ctx.comm, grad.contiguous(), *ctx.args),) + (None,) * 6


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axes, split_dim, split_lengths, concat_dim, concat_lengths):
        ctx.args = comm, axes, split_dim, split_lengths, concat_dim, concat_lengths
        return _all_to_all(comm, t, axes, split_dim, split_lengths, concat_dim, concat_lengths)

    @staticmethod
    def backward(ctx, grad):
        comm, axes, split_dim, split_lengths, concat_dim, concat_lengths = ctx.args
        return (_all_to_all(comm, grad.contiguous(), axes, concat_dim, concat_lengths, split_dim, split_lengths),
                None, None, None, None, None, None)


def gather(comm, t: Tensor, axes: tuple[int, ...], dim: int, lengths: Sequence[int]) -> Tensor:
    """Every member's block of ``dim`` (``lengths`` in group order), concatenated."""
    return _Blocks.apply(t, comm, axes, dim, tuple(lengths), _gather, _own)


def split(comm, t: Tensor, axes: tuple[int, ...], dim: int, lengths: Sequence[int]) -> Tensor:
    """This rank's block of ``dim``, cut into blocks of ``lengths`` in group order."""
    return _Blocks.apply(t, comm, axes, dim, tuple(lengths), _own, _gather)


def reduce_scatter(comm, t: Tensor, axes: tuple[int, ...], dim: int, lengths: Sequence[int]) -> Tensor:
    """The sum over the group of each member's block of ``dim``, this rank's block kept."""
    return _Blocks.apply(t, comm, axes, dim, tuple(lengths), _reduce_scatter, _gather)


def all_to_all(comm, t: Tensor, axes: tuple[int, ...], split_dim: int, split_lengths: Sequence[int],
               concat_dim: int, concat_lengths: Sequence[int]) -> Tensor:
    """Block j of ``split_dim`` to member j; the pieces received concatenated along ``concat_dim``."""
    return _AllToAll.apply(t, comm, axes, split_dim, tuple(split_lengths), concat_dim, tuple(concat_lengths))
