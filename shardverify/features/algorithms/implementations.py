"""All-reduce written on point-to-point send/recv: user-level custom collectives.

They show how to write a collective on the raw :class:`Communicator` and verify it the
declarative way (``specs/collectives/naive_all_reduce.yaml``, ``ring_all_reduce.yaml``).

* :func:`naive_all_reduce`: every rank sends to a root, which sums and sends the result back.
  The root moves ``2 (p - 1) n`` elements, so its link is the bottleneck.
* :func:`ring_all_reduce`: reduce-scatter then all-gather around the ring of the group; the
  flattened tensor is cut into ``p`` chunks of ``numel // p`` or ``numel // p + 1`` elements,
  and every rank moves ``2 (p - 1) / p * n`` elements, the bandwidth-optimal amount.

Both are sums and differentiable: the backward of an all-reduce-sum is the same algorithm
on the gradients. On the process backend the transfers of a step are posted together with
``torch.distributed.isend/irecv`` (full duplex). Elsewhere the communicator's send/recv block,
so each ring step orders them by ring parity (even positions send first, odd positions
receive first), which cannot deadlock whether the transport buffers sends or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from shardverify.collectives.functional import group_ranks, normalize_axes
from shardverify.errors import CollectiveError

__all__ = ["RingStep", "RingSchedule", "ring_schedule", "chunk_bounds", "ring_all_reduce",
           "naive_all_reduce"]


@dataclass(frozen=True)
class RingStep:
    """One ring step: send chunk ``send`` to the right neighbour, receive chunk ``recv``
    from the left one."""

    send: int
    recv: int


@dataclass(frozen=True)
class RingSchedule:
    reduce_scatter: tuple[RingStep, ...]   # received chunks are added to the local ones
    all_gather: tuple[RingStep, ...]       # received chunks replace the local ones


def ring_schedule(position: int, p: int) -> RingSchedule:
    """The chunk indices the rank at ``position`` of a ring of ``p`` moves at each step.

    Reduce-scatter step ``s`` sends chunk ``position - s`` (complete over ``s + 1`` ranks)
    and receives chunk ``position - s - 1``; after ``p - 1`` steps the rank holds the full
    sum of chunk ``position + 1``, which the all-gather steps pass on around the ring."""
    if p < 1 or not 0 <= position < p:
        raise CollectiveError(f"ring position {position} is not in a ring of {p} ranks")
    reduce_scatter = tuple(RingStep((position - s) % p, (position - s - 1) % p) for s in range(p - 1))
    all_gather = tuple(RingStep((position + 1 - s) % p, (position - s) % p) for s in range(p - 1))
    return RingSchedule(reduce_scatter, all_gather)


def chunk_bounds(numel: int, p: int) -> tuple[tuple[int, int], ...]:
    """``p`` contiguous ``[start, end)`` ranges covering ``numel`` elements whose sizes differ
    by at most one (some are empty when ``numel < p``)."""
    return tuple((i * numel // p, (i + 1) * numel // p) for i in range(p))


def _p2p(comm, native: bool, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]],
         send_first: bool) -> list[Tensor]:
    """Send each ``(tensor, dst)`` and receive a tensor like each ``(like, src)``.

    On a real process group (``native``) every transfer is posted at once with
    ``torch.distributed.isend/irecv``, so a rank sends and receives at the same time (full
    duplex); the communicator's counters are kept the same as for its own send/recv. Both
    ends compute the sizes, so no metadata exchange is needed. Elsewhere the communicator's
    blocking send/recv run in the order ``send_first`` says."""
    if native:
        import torch.distributed as dist

        received = [torch.empty_like(like) for like, _ in recvs]
        requests = [dist.isend(t.contiguous(), dst) for t, dst in sends]
        requests += [dist.irecv(buf, src) for buf, (_, src) in zip(received, recvs)]
        comm.counts[("send", ())] += len(sends)
        comm.counts[("recv", ())] += len(recvs)
        for request in requests:
            request.wait()
        return received
    if send_first:
        for t, dst in sends:
            comm.send(t, dst)
    received = [comm.recv(like, src) for like, src in recvs]
    if not send_first:
        for t, dst in sends:
            comm.send(t, dst)
    return received


def _native(comm, axes: tuple[int, ...]) -> bool:
    """Whether ``comm`` sits on a real torch.distributed world (the process backend)."""
    return getattr(comm, "process_group", lambda _axes: None)(axes) is not None


def _ring(comm, t: Tensor, axes: tuple[int, ...]) -> Tensor:
    ranks = group_ranks(comm, axes)
    p, position = len(ranks), ranks.index(comm.rank)
    flat = t.detach().reshape(-1).clone()
    if p == 1:
        return flat.reshape(t.shape)
    right, left = ranks[(position + 1) % p], ranks[(position - 1) % p]
    bounds = chunk_bounds(flat.numel(), p)
    schedule = ring_schedule(position, p)
    send_first = position % 2 == 0

    def chunk(index: int) -> Tensor | None:
        start, end = bounds[index]
        return flat[start:end] if end > start else None

    native = _native(comm, axes)

    def move(step: RingStep) -> Tensor | None:
        """One ring step; an empty chunk is neither sent nor received (both ends know)."""
        out, into = chunk(step.send), chunk(step.recv)
        sends = [] if out is None else [(out, right)]
        recvs = [] if into is None else [(into, left)]
        got = _p2p(comm, native, sends, recvs, send_first)
        return got[0] if got else None

    for step in schedule.reduce_scatter:
        got = move(step)
        if got is not None:
            chunk(step.recv).add_(got)
    for step in schedule.all_gather:
        got = move(step)
        if got is not None:
            chunk(step.recv).copy_(got)
    return flat.reshape(t.shape)


def _naive(comm, t: Tensor, axes: tuple[int, ...], root: int) -> Tensor:
    ranks = group_ranks(comm, axes)
    native = _native(comm, axes)
    local = t.detach().contiguous()
    if comm.rank != ranks[root]:
        _p2p(comm, native, [(local, ranks[root])], [], send_first=True)
        return _p2p(comm, native, [], [(local, ranks[root])], send_first=False)[0]
    others = [member for member in ranks if member != comm.rank]
    received = dict(zip(others, _p2p(comm, native, [], [(local, m) for m in others], send_first=False)))
    total = torch.zeros_like(local)
    for member in ranks:  # group order, so every run sums in the same order
        total += local if member == comm.rank else received[member]
    _p2p(comm, native, [(total, m) for m in others], [], send_first=True)
    return total


class _RingAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axes):
        ctx.comm, ctx.axes = comm, axes
        return _ring(comm, t, axes)

    @staticmethod
    def backward(ctx, grad):
        return _ring(ctx.comm, grad, ctx.axes), None, None


class _NaiveAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axes, root):
        ctx.comm, ctx.axes, ctx.root = comm, axes, root
        return _naive(comm, t, axes, root)

    @staticmethod
    def backward(ctx, grad):
        return _naive(ctx.comm, grad, ctx.axes, ctx.root), None, None, None


def _check_input(t: object, what: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise CollectiveError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def ring_all_reduce(comm, t: Tensor, axes: int | Sequence[int]) -> Tensor:
    """Sum of ``t`` over the group by a ring reduce-scatter + all-gather on send/recv.
    Any shape (0-d included); sizes need not divide by the group size."""
    axes = normalize_axes(comm, axes)
    return _RingAllReduce.apply(_check_input(t, "ring_all_reduce"), comm, axes)


def naive_all_reduce(comm, t: Tensor, axes: int | Sequence[int], root: int = 0) -> Tensor:
    """Sum of ``t`` over the group: everyone sends to the rank at position ``root``, which
    sums in group order and sends the result back."""
    axes = normalize_axes(comm, axes)
    p = len(group_ranks(comm, axes))
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < p:
        raise CollectiveError(f"naive_all_reduce: root={root!r} is not a position in a group of "
                              f"size {p} (expected 0 <= root < {p})")
    return _NaiveAllReduce.apply(_check_input(t, "naive_all_reduce"), comm, axes, root)
