"""Running a planned reshard (:func:`shardverify.sharding.reshard_plan.plan_reshard`) on one
rank's local tensor, differentiably, with the functional collectives. A step whose blocks are
all the same length runs the strategies' own patterns; one that moves blocks of unequal length
(a dim that does not divide, cut DTensor's way) runs the padded collectives of
:mod:`shardverify.collectives.uneven`, with every block's length known from the step's layout."""

from __future__ import annotations

import torch
from torch import Tensor

from shardverify.collectives import functional as F
from shardverify.collectives import uneven
from shardverify.collectives.patterns import apply_comm_action
from shardverify.sharding.blocks import nested_block
from shardverify.sharding.reshard_plan import ReshardStep
from shardverify.sharding.strategy import CommAction, CommPattern, CommWhere

__all__ = ["apply_step", "apply_reshard"]


class _ZeroPartial(torch.autograd.Function):
    """Replicated -> partial over ``axes``: position 0 keeps the value, the others hold zeros.
    The partial result's gradient is replicated, and so is the source's: identity backward."""

    @staticmethod
    def forward(ctx, t, keep):
        return t.clone() if keep else torch.zeros_like(t)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def block_lengths(comm, step: ReshardStep, dim: int, prefix: tuple[int, ...], group: tuple[int, ...]) -> list[int]:
    """The length along ``dim`` of each member's block (group order over ``group``) of this
    rank's block of ``S<prefix>`` cut further over ``group``."""
    mesh = comm.mesh
    coord = mesh.coordinate(comm.rank)
    _, parent = nested_block(step.shape[dim], [(mesh.shape[a], coord[a]) for a in prefix])
    return [nested_block(parent, [(mesh.shape[a], mesh.coordinate(member)[a]) for a in group])[1]
            for member in mesh.group_ranks(comm.rank, group)]


def _uneven_step(comm, step: ReshardStep, t: Tensor) -> Tensor | None:
    """The step with padded collectives when the blocks it moves differ in length; None when
    they are all equal (the patterns' even collectives serve), or the step carries no layout."""
    if not step.shape or step.kind not in ("all_gather", "split", "reduce_scatter", "all_to_all"):
        return None
    if step.kind == "all_to_all":
        split_dim, concat_dim = step.dims
        split = block_lengths(comm, step, split_dim, step.held[split_dim], step.axes)
        concat = block_lengths(comm, step, concat_dim, step.held[concat_dim][:-len(step.axes)], step.axes)
        if len(set(split)) == 1 and len(set(concat)) == 1:
            return None
        return uneven.all_to_all(comm, t, step.axes, split_dim, split, concat_dim, concat)
    (dim,) = step.dims
    held = step.held[dim]
    prefix = held[:-len(step.axes)] if step.kind == "all_gather" else held
    lengths = block_lengths(comm, step, dim, prefix, step.axes)
    if len(set(lengths)) == 1:
        return None
    run = {"all_gather": uneven.gather, "split": uneven.split, "reduce_scatter": uneven.reduce_scatter}[step.kind]
    return run(comm, t, step.axes, dim, lengths)


def apply_step(comm, step: ReshardStep, t: Tensor) -> Tensor:
    """Run one step on this rank's local tensor (differentiable)."""
    moved = _uneven_step(comm, step, t)
    if moved is not None:
        return moved

    def action(pattern: CommPattern, dims: tuple[int, ...] = ()) -> Tensor:
        return apply_comm_action(comm, CommAction(pattern, step.axes, "reshard", CommWhere.BEFORE, dims), t)

    if step.kind == "all_reduce":
        return action(CommPattern.ALLREDUCE_FWD_IDENTITY_BWD)
    if step.kind == "reduce_scatter":
        return F.reduce_scatter(comm, t, step.axes, step.dims[0])
    if step.kind == "all_gather":
        return action(CommPattern.GATHER_FWD_SPLIT_BWD, step.dims)
    if step.kind == "split":
        return action(CommPattern.SPLIT_FWD_GATHER_BWD, step.dims)
    if step.kind == "all_to_all":
        return action(CommPattern.ALL2ALL_FWD_ALL2ALL_BWD, step.dims)
    return _ZeroPartial.apply(t, F.group_position(comm, step.axes) == 0)


def apply_reshard(comm, steps, t: Tensor) -> Tensor:
    for step in steps:
        t = apply_step(comm, step, t)
    return t
