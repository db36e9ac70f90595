"""Running a planned reshard (:func:`shardverify.sharding.reshard_plan.plan_reshard`) on one
rank's local tensor, differentiably, with the functional collectives."""

from __future__ import annotations

import torch
from torch import Tensor

from shardverify.collectives import functional as F
from shardverify.collectives.patterns import apply_comm_action
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


def apply_step(comm, step: ReshardStep, t: Tensor) -> Tensor:
    """Run one step on this rank's local tensor (differentiable)."""
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
