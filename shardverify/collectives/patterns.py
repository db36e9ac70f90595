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

Every half and Function runs on the ranks its caller holds, one tensor per rank: one for a rank
thread or process (:class:`OneRank`, its communicator's own collectives; the per-rank functions
``apply_comm_action``, ``before_op``... are this case), every rank of the mesh for the simulated
mesh's strategy check (``backends.stacked.AllRanks``: each exchange over all of them at once, and
autograd runs each backward half once for all ranks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from shardverify.collectives.functional import group_position, group_size, split_along
from shardverify.errors import CollectiveError
from shardverify.sharding.indexing import shift_into_shard, zero_outside_shard
from shardverify.sharding.strategy import CommAction, CommPattern, CommWhere

__all__ = ["OneRank", "apply_comm_action", "apply_on_ranks", "apply_grad_hook", "grad_hook_on_ranks",
           "before_op", "before_op_on_ranks", "after_op", "after_op_on_ranks", "zero_outside_index_shards",
           "aligned"]

Half = Callable[[object, CommAction, list], list]


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


class OneRank:
    """The ranks a caller holds when it holds one: a rank thread's or a process's communicator.
    Every pattern below runs on a sequence of ranks (``comms``, each with its ``rank`` and
    ``mesh``) and their tensors, one per rank; with one, each exchange is that communicator's
    own collective.  (``backends.stacked.AllRanks`` holds every rank of a mesh in one thread and
    computes each exchange over all of them at once.)"""

    __slots__ = ("comms", "mesh")

    def __init__(self, comm) -> None:
        self.comms = (comm,)
        self.mesh = comm.mesh

    def all_reduce(self, ts: list, axes: tuple[int, ...], op: str) -> list:
        return [self.comms[0].all_reduce(ts[0], axes, op)]

    def all_gather(self, ts: list, axes: tuple[int, ...]) -> list:
        return [self.comms[0].all_gather(ts[0], axes)]

    def all_to_all(self, chunk_lists: list, axes: tuple[int, ...]) -> list:
        return [self.comms[0].all_to_all(chunk_lists[0], axes)]


def _identity(ranks, action: CommAction, ts: list) -> list:
    return ts


def _all_reduce(ranks, action: CommAction, ts: list) -> list:
    return ranks.all_reduce([t.contiguous() for t in ts], action.axes, "sum")


def _reduce_partial(ranks, action: CommAction, ts: list) -> list:
    """Forward half of ALLREDUCE_FWD_IDENTITY_BWD with ``action.op``: avg divides the sum by
    the group size; max/min reduce elementwise."""
    if action.op == "avg":
        p = group_size(ranks.comms[0], action.axes)
        return [t / p for t in ranks.all_reduce([t.contiguous() for t in ts], action.axes, "sum")]
    return ranks.all_reduce([t.contiguous() for t in ts], action.axes, action.op)


def _gather(ranks, action: CommAction, ts: list) -> list:
    dims = [_dim(action, t, 0) for t in ts]
    return [torch.cat(parts, dim) for parts, dim in zip(ranks.all_gather([t.contiguous() for t in ts], action.axes),
                                                         dims)]


def _split(ranks, action: CommAction, ts: list) -> list:
    out = []
    for comm, t in zip(ranks.comms, ts):
        dim = _dim(action, t, 0)
        p = group_size(comm, action.axes)
        _divisible(action, t, dim, p)
        out.append(split_along(t, dim, p)[group_position(comm, action.axes)])
    return out


def _all_to_all(ranks, action: CommAction, ts: list, split_index: int, concat_index: int) -> list:
    chunk_lists, concat_dims = [], []
    for comm, t in zip(ranks.comms, ts):
        split_dim, concat_dim = _dim(action, t, split_index), _dim(action, t, concat_index)
        p = group_size(comm, action.axes)
        _divisible(action, t, split_dim, p)
        chunk_lists.append(split_along(t, split_dim, p))
        concat_dims.append(concat_dim)
    return [torch.cat(parts, dim) for parts, dim in zip(ranks.all_to_all(chunk_lists, action.axes), concat_dims)]


def _all_to_all_fwd(ranks, action: CommAction, ts: list) -> list:
    return _all_to_all(ranks, action, ts, 0, 1)


def _all_to_all_bwd(ranks, action: CommAction, ts: list) -> list:
    return _all_to_all(ranks, action, ts, 1, 0)


_HALVES: dict[CommPattern, tuple[Half, Half]] = {
    CommPattern.ALLREDUCE_FWD_IDENTITY_BWD: (_all_reduce, _identity),
    CommPattern.IDENTITY_FWD_ALLREDUCE_BWD: (_identity, _all_reduce),
    CommPattern.GATHER_FWD_SPLIT_BWD: (_gather, _split),
    CommPattern.SPLIT_FWD_GATHER_BWD: (_split, _gather),
    CommPattern.ALL2ALL_FWD_ALL2ALL_BWD: (_all_to_all_fwd, _all_to_all_bwd),
}


def _forward_half(ranks, action: CommAction, ts: list) -> list:
    if action.op != "sum":
        return _reduce_partial(ranks, action, ts)
    return _HALVES[action.pattern][0](ranks, action, ts)


class _ReducePartial(torch.autograd.Function):
    """A partial output reduced with avg/max/min. The output is then replicated over the
    axes, so its gradient is the same on every rank: avg hands each rank ``grad / p``;
    max/min hand it to the rank(s) whose local value is the extremum, split evenly among
    ties (as torch.amax does), counting the holders with one all-reduce."""

    @staticmethod
    def forward(ctx, ranks, action, *ts):
        outs = _reduce_partial(ranks, action, list(ts))
        ctx.ranks, ctx.action = ranks, action
        if action.op in ("max", "min"):
            ctx.save_for_backward(*ts, *outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        ranks, action = ctx.ranks, ctx.action
        if action.op == "avg":
            return (None, None, *(g / group_size(comm, action.axes) for comm, g in zip(ranks.comms, grads)))
        saved = ctx.saved_tensors
        local, reduced = saved[:len(grads)], saved[len(grads):]
        holds = [(l == r).to(g.dtype) for l, r, g in zip(local, reduced, grads)]
        ties = ranks.all_reduce([h.contiguous() for h in holds], action.axes, "sum")
        return (None, None, *(g * h / n.clamp_min(1) for g, h, n in zip(grads, holds, ties)))


class _Pattern(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ranks, action, *ts):
        ctx.ranks, ctx.action = ranks, action
        outs = _forward_half(ranks, action, list(ts))
        # An identity forward hands back the input itself; a fresh alias keeps autograd's
        # view bookkeeping out of the way.
        return tuple(out.view_as(out) if out is t else out for out, t in zip(outs, ts))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_HALVES[ctx.action.pattern][1](ctx.ranks, ctx.action, list(grads)))


def apply_comm_action(comm, action: CommAction, tensor: Tensor) -> Tensor:
    """Run the BEFORE/AFTER ``action`` on this rank's ``tensor``: the forward half now, the
    backward half when autograd propagates a gradient through the result."""
    return apply_on_ranks(OneRank(comm), action, [tensor])[0]


def apply_on_ranks(ranks, action: CommAction, tensors: list) -> list:
    """``apply_comm_action`` on each rank ``ranks`` holds, ``tensors[i]`` being the i-th's."""
    if not isinstance(action, CommAction):
        raise CollectiveError(f"apply_comm_action expects a CommAction, got {type(action).__name__}")
    if action.where is CommWhere.HOOK:
        raise CollectiveError(
            f"{action.pattern.name} on {action.operand!r} is a gradient HOOK; run it on the "
            f"gradient with apply_grad_hook")
    for tensor in tensors:
        if not isinstance(tensor, Tensor):
            raise CollectiveError(
                f"{action.pattern.name} on {action.operand!r} expects a tensor, got {type(tensor).__name__}")
    if action.op != "sum":
        return list(_ReducePartial.apply(ranks, action, *tensors))
    return list(_Pattern.apply(ranks, action, *tensors))


def apply_grad_hook(comm, action: CommAction, grad: Tensor) -> Tensor:
    """Run a HOOK ``action`` on a parameter's gradient: the backward half of its pattern
    (an all-reduce of the gradient for IDENTITY_FWD_ALLREDUCE_BWD)."""
    return grad_hook_on_ranks(OneRank(comm), action, [grad])[0]


def grad_hook_on_ranks(ranks, action: CommAction, grads: list) -> list:
    """``apply_grad_hook`` on each rank ``ranks`` holds."""
    if not isinstance(action, CommAction) or action.where is not CommWhere.HOOK:
        raise CollectiveError(f"apply_grad_hook expects a CommAction with where=HOOK, got {action!r}")
    with torch.no_grad():
        return _HALVES[action.pattern][1](ranks, action, list(grads))


def before_op(comm, strategy, name: str, tensor: Tensor, late: dict) -> Tensor:
    """What the op sees of input ``name``: ``tensor`` after its BEFORE actions. An operand the
    strategy post-adds is kept in ``late`` for :func:`after_op`, and the op sees zeros instead;
    ids into a sharded dim are shifted into this rank's shard (their mask kept in ``late``)."""
    return before_op_on_ranks(OneRank(comm), strategy, name, [tensor], [late])[0]


def before_op_on_ranks(ranks, strategy, name: str, tensors: list, lates: list) -> list:
    """``before_op`` on each rank ``ranks`` holds (``lates[i]``: the i-th rank's ``late``)."""
    for action in strategy.communication_actions:
        if action.operand == name and action.where is CommWhere.BEFORE:
            tensors = apply_on_ranks(ranks, action, tensors)
    post_added = strategy.post_added(name) is not None
    shard = strategy.index_shard(name)
    if not post_added and shard is None:   # the common case: the op sees the tensors themselves
        return list(tensors)
    out = []
    for comm, tensor, late in zip(ranks.comms, tensors, lates):
        if post_added:
            late[name] = tensor
            tensor = torch.zeros_like(tensor.detach())
        if shard is not None:
            rows = strategy.get_sharding_spec_by_name(shard.table).local_slices(comm.mesh, comm.rank)[shard.dim]
            tensor, late[("outside", name)] = shift_into_shard(tensor, rows.start, rows.stop - rows.start)
        out.append(tensor)
    return out


def after_op(comm, strategy, outputs: list, late: dict, keep_partial: tuple[int, ...] | None = None) -> list:
    """The op's outputs (in place) after their AFTER actions, then the post-added operands.
    An all-reduce over ``keep_partial`` axes is left out: a plan's resharding reduces it.
    The outputs of ids outside this rank's shard are zeroed first (see :func:`before_op`)."""
    return after_op_on_ranks(OneRank(comm), strategy, [outputs], [late], keep_partial)[0]


def after_op_on_ranks(ranks, strategy, outputs: list, lates: list,
                      keep_partial: tuple[int, ...] | None = None) -> list:
    """``after_op`` on each rank ``ranks`` holds: ``outputs[i]`` (changed in place) and
    ``lates[i]`` are the i-th rank's."""
    if strategy.index_shards:
        for outs, late in zip(outputs, lates):
            zero_outside_index_shards(strategy, outs, late)
    count = min([len(outs) for outs in outputs])
    for index, data in enumerate(strategy.outputs[:count]):
        for action in strategy.communication_actions:
            if action.operand == data.name and action.where is CommWhere.AFTER and action.axes != keep_partial:
                for outs, t in zip(outputs, apply_on_ranks(ranks, action, [outs[index] for outs in outputs])):
                    outs[index] = t
    for add in strategy.post_add:
        for outs, late in zip(outputs, lates):
            if add.output < len(outs):
                out = outs[add.output]
                outs[add.output] = out + aligned(late[add.operand], add.dims, out.dim())
    return outputs


def zero_outside_index_shards(strategy, outputs: list, late: dict) -> None:
    """A rank's op outputs (changed in place) with those of ids outside its index shard zeroed,
    the mask its :func:`before_op` kept in ``late``."""
    for shard in strategy.index_shards:
        if shard.output < len(outputs) and ("outside", shard.index) in late:
            outputs[shard.output] = zero_outside_shard(outputs[shard.output], late[("outside", shard.index)])


def aligned(tensor: Tensor, dims: tuple[int, ...], out_rank: int) -> Tensor:
    """``tensor`` viewed so its dim i sits at output dim ``dims[i]`` (size 1 elsewhere)."""
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    moved = tensor.permute(order) if order != list(range(len(dims))) else tensor
    shape = [1] * out_rank
    for i in order:
        shape[dims[i]] = tensor.shape[i]
    return moved.reshape(shape)
