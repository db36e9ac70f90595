"""Differentiable collectives over mesh axes.

Every function here takes the rank's raw :class:`~shardverify.backends.base.Communicator`
and the mesh axes that form the group, runs the same code on every backend (simulated
threads or real process groups) and is an ``autograd.Function`` whose backward is the
adjoint of its forward:

=====================  ===========================================================
forward                backward
=====================  ===========================================================
all_reduce (sum)       all_reduce (sum) of the gradients
all_reduce (max/min)   one all_reduce: the gradient summed over ranks reaches the
                       rank(s) holding the extremum, split evenly among ties
all_gather (dim)       reduce_scatter (dim)
reduce_scatter (dim)   all_gather (dim)
all_to_all (s, c)      all_to_all (c, s)
broadcast (src)        reduce-sum to src (other ranks get zero gradients)
reduce (dst)           broadcast from dst
gather (dim, dst)      scatter from dst
scatter (dim, src)     gather to src (other ranks get zero gradients)
send / recv            recv / send
=====================  ===========================================================

Backward is SPMD like forward: every rank of the group has to run backward through the
op, because the adjoint is itself a collective. Ops that define no result on some ranks
(reduce and gather off the root, send) return ``None`` there; while autograd records a
graph through them (grad mode on and the input requires grad) they return instead a
zero placeholder that carries the graph, so those ranks can join the backward pass (its
own gradient is ignored: the placeholder is a constant).

Group order is ``mesh.group_ranks(rank, axes)``: the chunk at position ``i`` of an
all-gather, reduce-scatter, all-to-all, gather or scatter belongs to the ``i``-th rank of
that order, and ``src``/``dst`` are positions in it. Arguments are validated eagerly and
raise :class:`~shardverify.errors.CollectiveError`; shape or dtype mismatches between
ranks are found by the backend's metadata exchange and raise the same error on every
rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from shardverify.errors import CollectiveError

__all__ = [
    "REDUCE_OPS",
    "normalize_axes",
    "group_ranks",
    "group_position",
    "group_size",
    "split_along",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
]

REDUCE_OPS = ("sum", "max", "min")


# --------------------------------------------------------------------------- validation


def normalize_axes(comm, axes: int | Sequence[int]) -> tuple[int, ...]:
    """``axes`` as a tuple of distinct mesh axes of ``comm.mesh`` (an int means one axis)."""
    raw = (axes,) if isinstance(axes, int) else tuple(axes)
    ndim = len(comm.mesh.shape)
    for axis in raw:
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise CollectiveError(f"mesh axes must be ints, got {axes!r}")
        if not 0 <= axis < ndim:
            raise CollectiveError(
                f"mesh axis {axis} out of range for mesh shape {tuple(comm.mesh.shape)} "
                f"(axes {raw!r}); expected 0 <= axis < {ndim}")
    if len(set(raw)) != len(raw):
        raise CollectiveError(f"mesh axes {raw!r} repeat an axis")
    if not raw:
        raise CollectiveError("a collective needs at least one mesh axis, got axes=()")
    return raw


def group_ranks(comm, axes: int | Sequence[int]) -> tuple[int, ...]:
    """Global ranks of this rank's group over ``axes``, in group order."""
    return tuple(comm.mesh.group_ranks(comm.rank, normalize_axes(comm, axes)))


def group_position(comm, axes: int | Sequence[int]) -> int:
    """This rank's position in its group over ``axes``."""
    return group_ranks(comm, axes).index(comm.rank)


def group_size(comm, axes: int | Sequence[int]) -> int:
    return len(group_ranks(comm, axes))


def _check_tensor(t: object, what: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise CollectiveError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _check_dim(t: Tensor, dim: int, what: str, name: str = "dim") -> int:
    """Normalise ``dim`` (negative allowed) against ``t``; 0-d tensors have no dims."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise CollectiveError(f"{what}: {name} must be an int, got {dim!r}")
    if t.dim() == 0:
        raise CollectiveError(f"{what}: {name}={dim} given for a 0-d tensor, which has no dims")
    if not -t.dim() <= dim < t.dim():
        raise CollectiveError(
            f"{what}: {name}={dim} out of range for a tensor of shape {tuple(t.shape)} "
            f"(expected {-t.dim()} <= {name} < {t.dim()})")
    return dim % t.dim()


def _check_divisible(t: Tensor, dim: int, p: int, what: str, name: str = "dim") -> None:
    if t.shape[dim] % p:
        raise CollectiveError(
            f"{what}: size {t.shape[dim]} of {name}={dim} (shape {tuple(t.shape)}) is not "
            f"divisible by the group size {p}")


def _check_position(value: int, p: int, what: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < p:
        raise CollectiveError(
            f"{what}: {name}={value!r} is not a position in a group of size {p} "
            f"(expected 0 <= {name} < {p})")
    return value


def split_along(t: Tensor, dim: int, p: int) -> list[Tensor]:
    """``p`` equal contiguous chunks of ``t`` along ``dim`` (size divisible by ``p``)."""
    size = t.shape[dim] // p
    return [t.narrow(dim, i * size, size).contiguous() for i in range(p)]


def _recording(t: Tensor) -> bool:
    return torch.is_grad_enabled() and t.requires_grad


# --------------------------------------------------------------------------- all_reduce


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axes, op):
        out = comm.all_reduce(t.contiguous(), axes, op)
        ctx.comm, ctx.axes, ctx.op = comm, axes, op
        if op != "sum":
            ctx.save_for_backward(t, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        comm, axes = ctx.comm, ctx.axes
        if ctx.op == "sum":
            return comm.all_reduce(grad.contiguous(), axes, "sum"), None, None, None
        x, y = ctx.saved_tensors
        holds = (x == y).to(grad.dtype)
        # One collective: the summed gradient and the number of ranks holding the extremum.
        both = comm.all_reduce(torch.stack([grad, holds]).contiguous(), axes, "sum")
        total, ties = both[0], both[1]
        return total * holds / ties.clamp_min(1), None, None, None


def all_reduce(comm, t: Tensor, axes: int | Sequence[int], op: str = "sum") -> Tensor:
    """Elementwise ``op`` (sum, max, min) of ``t`` over the group; every rank gets the result.

    Backward of sum: the sum of the gradients of every rank. Backward of max/min: the
    gradients summed over ranks flow to the rank(s) whose element equals the extremum; with
    ties the gradient is split evenly among them (as ``torch.amax`` does), so the total
    gradient is conserved.
    """
    what = f"all_reduce(op={op!r})"
    _check_tensor(t, what)
    if op not in REDUCE_OPS:
        raise CollectiveError(f"{what}: op must be one of {REDUCE_OPS}, got {op!r}")
    return _AllReduce.apply(t, comm, normalize_axes(comm, axes), op)


# --------------------------------------------------------------------------- all_gather / reduce_scatter


def _gather_cat(comm, t: Tensor, axes, dim: int) -> Tensor:
    return torch.cat(comm.all_gather(t.contiguous(), axes), dim)


def _scatter_reduce(comm, t: Tensor, axes, dim: int) -> Tensor:
    return comm.reduce_scatter(split_along(t, dim, len(comm.mesh.group_ranks(comm.rank, axes))),
                               axes, "sum")


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axes, dim):
        ctx.comm, ctx.axes, ctx.dim = comm, axes, dim
        return _gather_cat(comm, t, axes, dim)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_reduce(ctx.comm, grad, ctx.axes, ctx.dim), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axes, dim):
        ctx.comm, ctx.axes, ctx.dim = comm, axes, dim
        return _scatter_reduce(comm, t, axes, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather_cat(ctx.comm, grad, ctx.axes, ctx.dim), None, None, None


def all_gather(comm, t: Tensor, axes: int | Sequence[int], dim: int = 0) -> Tensor:
    """Concatenate every rank's ``t`` along ``dim`` in group order.

    Backward: reduce-scatter of the gradient along ``dim`` (each rank gets the sum of
    every rank's gradient for its own chunk).
    """
    what = f"all_gather(dim={dim!r})"
    axes = normalize_axes(comm, axes)
    dim = _check_dim(_check_tensor(t, what), dim, what)
    return _AllGather.apply(t, comm, axes, dim)


def reduce_scatter(comm, t: Tensor, axes: int | Sequence[int], dim: int = 0) -> Tensor:
    """Sum ``t`` over the group and keep this rank's chunk along ``dim`` (size divisible by
    the group size). Backward: all-gather of the gradient along ``dim``."""
    what = f"reduce_scatter(dim={dim!r})"
    axes = normalize_axes(comm, axes)
    dim = _check_dim(_check_tensor(t, what), dim, what)
    _check_divisible(t, dim, group_size(comm, axes), what)
    return _ReduceScatter.apply(t, comm, axes, dim)


# --------------------------------------------------------------------------- all_to_all


def _all_to_all(comm, t: Tensor, axes, split_dim: int, concat_dim: int) -> Tensor:
    p = len(comm.mesh.group_ranks(comm.rank, axes))
    return torch.cat(comm.all_to_all(split_along(t, split_dim, p), axes), concat_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axes, split_dim, concat_dim):
        ctx.comm, ctx.axes, ctx.dims = comm, axes, (split_dim, concat_dim)
        return _all_to_all(comm, t, axes, split_dim, concat_dim)

    @staticmethod
    def backward(ctx, grad):
        split_dim, concat_dim = ctx.dims
        return _all_to_all(ctx.comm, grad, ctx.axes, concat_dim, split_dim), None, None, None, None


def all_to_all(comm, t: Tensor, axes: int | Sequence[int], split_dim: int, concat_dim: int) -> Tensor:
    """Split ``t`` into group-size chunks along ``split_dim``, send chunk ``i`` to the rank at
    position ``i``, and concatenate what arrives along ``concat_dim`` in group order.
    Backward: the same exchange with the two dims swapped."""
    what = f"all_to_all(split_dim={split_dim!r}, concat_dim={concat_dim!r})"
    axes = normalize_axes(comm, axes)
    split_dim = _check_dim(_check_tensor(t, what), split_dim, what, "split_dim")
    concat_dim = _check_dim(t, concat_dim, what, "concat_dim")
    _check_divisible(t, split_dim, group_size(comm, axes), what, "split_dim")
    return _AllToAll.apply(t, comm, axes, split_dim, concat_dim)


# --------------------------------------------------------------------------- rooted: broadcast / reduce


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axes, src):
        ctx.comm, ctx.axes, ctx.src = comm, axes, src
        return comm.broadcast(t.contiguous(), axes, src)

    @staticmethod
    def backward(ctx, grad):
        total = ctx.comm.all_reduce(grad.contiguous(), ctx.axes, "sum")
        mine = group_position(ctx.comm, ctx.axes) == ctx.src
        return (total if mine else torch.zeros_like(total)), None, None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axes, dst):
        ctx.comm, ctx.axes, ctx.dst = comm, axes, dst
        total = comm.all_reduce(t.contiguous(), axes, "sum")
        return total if group_position(comm, axes) == dst else torch.zeros_like(total)

    @staticmethod
    def backward(ctx, grad):
        mine = group_position(ctx.comm, ctx.axes) == ctx.dst
        seed = grad.contiguous() if mine else torch.zeros_like(grad)
        return ctx.comm.broadcast(seed, ctx.axes, ctx.dst), None, None, None


def broadcast(comm, t: Tensor, axes: int | Sequence[int], src: int = 0) -> Tensor:
    """Every rank gets the ``t`` of the rank at group position ``src``; every rank passes a
    tensor of the same shape and dtype (its values are ignored off ``src``).
    Backward: the gradients are summed onto ``src``; other ranks' inputs get zeros."""
    what = f"broadcast(src={src!r})"
    axes = normalize_axes(comm, axes)
    _check_position(src, group_size(comm, axes), what, "src")
    return _Broadcast.apply(_check_tensor(t, what), comm, axes, src)


def reduce(comm, t: Tensor, axes: int | Sequence[int], dst: int = 0) -> Tensor | None:
    """Sum of ``t`` over the group on the rank at group position ``dst``; ``None`` elsewhere
    (a zero placeholder while autograd records, see the module docstring).
    Backward: the gradient on ``dst`` is broadcast to every rank's input."""
    what = f"reduce(dst={dst!r})"
    axes = normalize_axes(comm, axes)
    _check_position(dst, group_size(comm, axes), what, "dst")
    out = _Reduce.apply(_check_tensor(t, what), comm, axes, dst)
    return out if _recording(t) or group_position(comm, axes) == dst else None


# --------------------------------------------------------------------------- rooted: gather / scatter


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axes, dim, dst):
        ctx.comm, ctx.axes, ctx.dim, ctx.dst = comm, axes, dim, dst
        full = _gather_cat(comm, t, axes, dim)
        return full if group_position(comm, axes) == dst else torch.zeros_like(full)

    @staticmethod
    def backward(ctx, grad):
        comm, axes = ctx.comm, ctx.axes
        pos = group_position(comm, axes)
        seed = grad.contiguous() if pos == ctx.dst else torch.zeros_like(grad)
        full = comm.broadcast(seed, axes, ctx.dst)
        return split_along(full, ctx.dim, group_size(comm, axes))[pos], None, None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axes, dim, src):
        ctx.comm, ctx.axes, ctx.dim, ctx.src = comm, axes, dim, src
        full = comm.broadcast(t.contiguous(), axes, src)
        return split_along(full, dim, group_size(comm, axes))[group_position(comm, axes)]

    @staticmethod
    def backward(ctx, grad):
        comm, axes = ctx.comm, ctx.axes
        full = _gather_cat(comm, grad, axes, ctx.dim)
        mine = group_position(comm, axes) == ctx.src
        return (full if mine else torch.zeros_like(full)), None, None, None, None


def gather(comm, t: Tensor, axes: int | Sequence[int], dim: int = 0, dst: int = 0) -> Tensor | None:
    """Every rank's ``t`` concatenated along ``dim`` in group order, on the rank at position
    ``dst``; ``None`` elsewhere (a zero placeholder while autograd records).
    Backward: scatter of the gradient on ``dst`` back to the ranks, chunk by chunk."""
    what = f"gather(dim={dim!r}, dst={dst!r})"
    axes = normalize_axes(comm, axes)
    dim = _check_dim(_check_tensor(t, what), dim, what)
    _check_position(dst, group_size(comm, axes), what, "dst")
    out = _Gather.apply(t, comm, axes, dim, dst)
    return out if _recording(t) or group_position(comm, axes) == dst else None


def scatter(comm, t: Tensor, axes: int | Sequence[int], dim: int = 0, src: int = 0) -> Tensor:
    """Chunk ``i`` along ``dim`` of the ``t`` held by position ``src`` goes to position ``i``.
    Every rank passes a tensor of the same shape (values ignored off ``src``), whose
    ``dim`` is divisible by the group size.
    Backward: the chunks' gradients are gathered onto ``src``; other inputs get zeros."""
    what = f"scatter(dim={dim!r}, src={src!r})"
    axes = normalize_axes(comm, axes)
    dim = _check_dim(_check_tensor(t, what), dim, what)
    p = group_size(comm, axes)
    _check_divisible(t, dim, p, what)
    _check_position(src, p, what, "src")
    return _Scatter.apply(t, comm, axes, dim, src)


# --------------------------------------------------------------------------- point to point


def _check_peer(comm, peer: int, what: str, name: str) -> int:
    world = len(comm.mesh.ranks)
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < world:
        raise CollectiveError(f"{what}: {name}={peer!r} is not a rank of a mesh of {world} ranks")
    if peer == comm.rank:
        raise CollectiveError(f"{what}: rank {comm.rank} cannot exchange with itself ({name}={peer})")
    return peer


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, dst):
        ctx.comm, ctx.dst = comm, dst
        ctx.save_for_backward(t)
        comm.send(t.contiguous(), dst)
        return t.new_zeros(())

    @staticmethod
    def backward(ctx, _token_grad):
        (t,) = ctx.saved_tensors
        return ctx.comm.recv(torch.empty_like(t, memory_format=torch.contiguous_format), ctx.dst), \
            None, None


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, like, comm, src):
        ctx.comm, ctx.src = comm, src
        return comm.recv(like.detach().contiguous(), src)

    @staticmethod
    def backward(ctx, grad):
        ctx.comm.send(grad.contiguous(), ctx.src)
        return None, None, None


def send(comm, t: Tensor, dst: int) -> Tensor | None:
    """Send ``t`` to global rank ``dst``. Returns ``None``, or while autograd records a 0-d
    zero token: backpropagating through it receives the gradient of ``t`` from ``dst``
    (whose matching :func:`recv` sends it back)."""
    what = f"send(dst={dst!r})"
    _check_peer(comm, dst, what, "dst")
    token = _Send.apply(_check_tensor(t, what), comm, dst)
    return token if _recording(t) else None


def recv(comm, like: Tensor, src: int) -> Tensor:
    """Receive from global rank ``src`` a tensor with ``like``'s shape and dtype.

    The result takes part in autograd when ``like.requires_grad`` (``like`` is only a
    template; it gets no gradient): its backward sends the gradient back to ``src``, so the
    sender must have recorded its :func:`send` too."""
    what = f"recv(src={src!r})"
    _check_peer(comm, src, what, "src")
    return _Recv.apply(_check_tensor(like, what), comm, src)
