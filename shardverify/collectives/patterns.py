"""Execute a strategy's :class:`~shardverify.sharding.strategy.CommAction` with SPMD semantics.

Each :class:`~shardverify.sharding.strategy.CommPattern` is a pair (forward half, backward half) of
raw exchanges, run by one ``autograd.Function`` so the same code serves both backends:

================================  ======================  ========================
pattern                           forward                 backward
================================  ======================  ========================
ALLREDUCE_FWD_IDENTITY_BWD        all-reduce (sum)        identity
IDENTITY_FWD_ALLREDUCE_BWD        identity                all-reduce (sum)
GATHER_FWD_SPLIT_BWD (d)          all-gather along d      keep own chunk along d
SPLIT_FWD_GATHER_BWD (d)          keep own chunk along d  all-gather along d
ALL2ALL_FWD_ALL2ALL_BWD (s, c)    all-to-all s -> c       all-to-all c -> s
================================  ======================  ========================

This is the Megatron-style convention: an ALLREDUCE_FWD_IDENTITY_BWD output is replicated,
so its gradient is already the same on every rank and needs no reduction. Each half that
communicates issues exactly one raw collective on ``action.axes`` (counted by the
communicator), which is what the verifier compares with the declared actions. Chunk ``i``
belongs to position ``i`` of ``mesh.group_ranks(rank, axes)``, the shard order of
``S<axes>``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from shardverify.collectives.functional import group_position, group_size, split_along
from shardverify.errors import CollectiveError
from shardverify.sharding.indexing import shift_into_shard, zero_outside_shard
from shardverify.sharding.strategy import CommAction, CommPattern, CommWhere

__all__ = ["apply_comm_action", "apply_grad_hook", "forward_half", "backward_half", "before_op", "after_op",
           "aligned"]

Half = Callable[[object, CommAction, Tensor], Tensor]


def _dim(action: CommAction, t: Tensor, index: int) -> int:
    dim = action.dims[index]
    if t.dim() == 0 or not -t.dim() <= dim < t.dim():
        raise CollectiveError(
            f"{action.pattern.name} on {action.operand!r}: tensor dim {dim} out of range for a "
            f"tensor of shape {tuple(t.shape)}")
    return dim % t.dim()


def _divisible(action: CommAction, t: Tensor, dim: int, p: int) -> None:
    if t.shape[dim] % p:
        raise CollectiveError(
            f"{action.pattern.name} on {action.operand!r}: size {t.shape[dim]} of dim {dim} "
            f"(shape {tuple(t.shape)}) is not divisible by the {p} ranks of mesh axes {action.axes}")


def _identity(comm, action: CommAction, t: Tensor) -> Tensor:
    return t


def _all_reduce(comm, action: CommAction, t: Tensor) -> Tensor:
    return comm.all_reduce(t.contiguous(), action.axes, "sum")


def _reduce_partial(comm, action: CommAction, t: Tensor) -> Tensor:
    """Forward half of ALLREDUCE_FWD_IDENTITY_BWD with ``action.op``: avg divides the sum by
    the group size; max/min reduce elementwise."""
    if action.op == "avg":
        return comm.all_reduce(t.contiguous(), action.axes, "sum") / group_size(comm, action.axes)
    return comm.all_reduce(t.contiguous(), action.axes, action.op)


def _gather(comm, action: CommAction, t: Tensor) -> Tensor:
    dim = _dim(action, t, 0)
    return torch.cat(comm.all_gather(t.contiguous(), action.axes), dim)


def _split(comm, action: CommAction, t: Tensor) -> Tensor:
    dim = _dim(action, t, 0)
    p = group_size(comm, action.axes)
    _divisible(action, t, dim, p)
    return split_along(t, dim, p)[group_position(comm, action.axes)]


def _all_to_all(comm, action: CommAction, t: Tensor, split_index: int, concat_index: int) -> Tensor:
    split_dim, concat_dim = _dim(action, t, split_index), _dim(action, t, concat_index)
    p = group_size(comm, action.axes)
    _divisible(action, t, split_dim, p)
    return torch.cat(comm.all_to_all(split_along(t, split_dim, p), action.axes), concat_dim)


def _all_to_all_fwd(comm, action: CommAction, t: Tensor) -> Tensor:
    return _all_to_all(comm, action, t, 0, 1)


def _all_to_all_bwd(comm, action: CommAction, t: Tensor) -> Tensor:
    return _all_to_all(comm, action, t, 1, 0)


_HALVES: dict[CommPattern, tuple[Half, Half]] = {
    CommPattern.ALLREDUCE_FWD_IDENTITY_BWD: (_all_reduce, _identity),
    CommPattern.IDENTITY_FWD_ALLREDUCE_BWD: (_identity, _all_reduce),
    CommPattern.GATHER_FWD_SPLIT_BWD: (_gather, _split),
    CommPattern.SPLIT_FWD_GATHER_BWD: (_split, _gather),
    CommPattern.ALL2ALL_FWD_ALL2ALL_BWD: (_all_to_all_fwd, _all_to_all_bwd),
}


def forward_half(comm, action: CommAction, t: Tensor) -> Tensor:
    """The forward exchange of ``action`` on ``t``, outside autograd."""
    if action.op != "sum":
        return _reduce_partial(comm, action, t)
    return _HALVES[action.pattern][0](comm, action, t)


def backward_half(comm, action: CommAction, grad: Tensor) -> Tensor:
    """The backward exchange of ``action`` on a gradient, outside autograd."""
    return _HALVES[action.pattern][1](comm, action, grad)


class _ReducePartial(torch.autograd.Function):
    """A partial output reduced with avg/max/min. The output is then replicated over the
    axes, so its gradient is the same on every rank: avg hands each rank ``grad / p``;
    max/min hand it to the rank(s) whose local value is the extremum, split evenly among
    ties (as torch.amax does), counting the holders with one all-reduce."""

    @staticmethod
    def forward(ctx, t, comm, action):
        out = _reduce_partial(comm, action, t)
        ctx.comm, ctx.action = comm, action
        if action.op in ("max", "min"):
            ctx.save_for_backward(t, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        comm, action = ctx.comm, ctx.action
        if action.op == "avg":
            return grad / group_size(comm, action.axes), None, None
        local, reduced = ctx.saved_tensors
        holds = (local == reduced).to(grad.dtype)
        ties = comm.all_reduce(holds.contiguous(), action.axes, "sum")
        return grad * holds / ties.clamp_min(1), None, None


class _Pattern(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, action):
        ctx.comm, ctx.action = comm, action
        out = forward_half(comm, action, t)
        # An identity forward hands back the input itself; a fresh alias keeps autograd's
        # view bookkeeping out of the way.
        return out.view_as(out) if out is t else out

    @staticmethod
    def backward(ctx, grad):
        return backward_half(ctx.comm, ctx.action, grad), None, None


def apply_comm_action(comm, action: CommAction, tensor: Tensor) -> Tensor:
    """Run the BEFORE/AFTER ``action`` on this rank's ``tensor``: the forward half now, the
    backward half when autograd propagates a gradient through the result."""
    if not isinstance(action, CommAction):
        raise CollectiveError(f"apply_comm_action expects a CommAction, got {type(action).__name__}")
    if action.where is CommWhere.HOOK:
        raise CollectiveError(
            f"{action.pattern.name} on {action.operand!r} is a gradient HOOK; run it on the "
            f"gradient with apply_grad_hook")
    if not isinstance(tensor, Tensor):
        raise CollectiveError(
            f"{action.pattern.name} on {action.operand!r} expects a tensor, got {type(tensor).__name__}")
    if action.op != "sum":
        return _ReducePartial.apply(tensor, comm, action)
    return _Pattern.apply(tensor, comm, action)


def apply_grad_hook(comm, action: CommAction, grad: Tensor) -> Tensor:
    """Run a HOOK ``action`` on a parameter's gradient: the backward half of its pattern
    (an all-reduce of the gradient for IDENTITY_FWD_ALLREDUCE_BWD)."""
    if not isinstance(action, CommAction) or action.where is not CommWhere.HOOK:
        raise CollectiveError(f"apply_grad_hook expects a CommAction with where=HOOK, got {action!r}")
    with torch.no_grad():
        return backward_half(comm, action, grad)


def before_op(comm, strategy, name: str, tensor: Tensor, late: dict) -> Tensor:
    """What the op sees of input ``name``: ``tensor`` after its BEFORE actions. An operand the
    strategy post-adds is kept in ``late`` for :func:`after_op`, and the op sees zeros instead;
    ids into a sharded dim are shifted into this rank's shard (their mask kept in ``late``)."""
    for action in strategy.communication_actions:
        if action.operand == name and action.where is CommWhere.BEFORE:
            tensor = apply_comm_action(comm, action, tensor)
    if strategy.post_added(name) is not None:
        late[name] = tensor
        tensor = torch.zeros_like(tensor.detach())
    shard = strategy.index_shard(name)
    if shard is not None:
        rows = strategy.get_sharding_spec_by_name(shard.table).local_slices(comm.mesh, comm.rank)[shard.dim]
        tensor, late[("outside", name)] = shift_into_shard(tensor, rows.start, rows.stop - rows.start)
    return tensor


def after_op(comm, strategy, outputs: list, late: dict, keep_partial: tuple[int, ...] | None = None) -> list:
    """The op's outputs (in place) after their AFTER actions, then the post-added operands.
    An all-reduce over ``keep_partial`` axes is left out: a plan's resharding reduces it.
    The outputs of ids outside this rank's shard are zeroed first (see :func:`before_op`)."""
    for shard in strategy.index_shards:
        if shard.output < len(outputs) and ("outside", shard.index) in late:
            outputs[shard.output] = zero_outside_shard(outputs[shard.output], late[("outside", shard.index)])
    for index, data in enumerate(strategy.outputs[:len(outputs)]):
        for action in strategy.communication_actions:
            if action.operand == data.name and action.where is CommWhere.AFTER and action.axes != keep_partial:
                outputs[index] = apply_comm_action(comm, action, outputs[index])
    for add in strategy.post_add:
        if add.output < len(outputs):
            out = outputs[add.output]
            outputs[add.output] = out + aligned(late[add.operand], add.dims, out.dim())
    return outputs


def aligned(tensor: Tensor, dims: tuple[int, ...], out_rank: int) -> Tensor:
    """``tensor`` viewed so its dim i sits at output dim ``dims[i]`` (size 1 elsewhere)."""
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    moved = tensor.permute(order) if order != list(range(len(dims))) else tensor
    shape = [1] * out_rank
    for i in order:
        shape[dims[i]] = tensor.shape[i]
    return moved.reshape(shape)
