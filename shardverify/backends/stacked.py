"""Every rank of a mesh in one thread: the collectives of a program written over the ranks it
holds (``collectives.patterns``'s ``*_on_ranks``, ``verify.rank.ranks_check``), computed over all
of them at once.

A check of a small op is mostly per-call work, and on the threaded simulated mesh each
collective is a hand-over between rank threads.  Held together, each step of the program runs
for every rank back to back, an exchange is a function of the ranks' tensors, and a backward
pass is one autograd call for all ranks.  The semantics are the communicators': each rank counts
the collectives it takes part in and the bytes it passes in (``CommunicatorBase``'s accounting),
ranks whose calls disagree (shape, dtype) fail as they would on a process group, results are
reduced in group order (bit-identical to the threaded mesh's) and every result is a tensor no
other rank holds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from shardverify.backends.base import (CommunicatorBase, _check_chunks, _check_op, _check_tensor, _nbytes,
                                       describe, disagreement, reduce_tensors)
from shardverify.errors import CollectiveError
from shardverify.sharding.mesh import DeviceMesh

__all__ = ["AllRanks", "RanksAtOnce", "StackedCommunicator"]


class StackedCommunicator(CommunicatorBase):
    """One rank of :class:`AllRanks`: its counts and traffic.  Its collectives run over all
    ranks at once, through the group; called on one rank alone they would wait forever."""

    def _refuse(self, *args) -> None:
        raise CollectiveError(f"rank {self.rank} of an AllRanks group cannot run a collective alone: "
                              f"its exchanges run over all ranks at once (AllRanks.all_reduce...)")

    _all_reduce = _all_gather = _reduce_scatter = _all_to_all = _broadcast = _send = _recv = _barrier = _refuse


class AllRanks:
    """Every rank of ``mesh``, held by one thread: ``comms[r]`` is rank r's communicator."""

    def __init__(self, mesh: DeviceMesh, device: torch.device | str = "cpu") -> None:
        self.mesh = mesh
        device = torch.device(device)
        self.comms = tuple(StackedCommunicator(mesh, rank, device) for rank in range(mesh.size))

    def _groups(self, kind: str, axes: Sequence[int], ts: list, nbytes) -> tuple[tuple[int, ...], ...]:
        """Count the call on every rank (as each rank's communicator counts its own: the call
        and the bytes passed in), and the ranks' groups over ``axes``, members in group order."""
        if len(ts) != len(self.comms):
            raise CollectiveError(f"{kind} over AllRanks needs one argument per rank ({len(self.comms)}), "
                                  f"got {len(ts)}")
        checked, groups = _partition(self.mesh, tuple(axes))
        for comm, t in zip(self.comms, ts):
            comm.counts[(kind, checked)] += 1
            comm.traffic[(kind, checked, nbytes(t))] += 1
        return groups

    @staticmethod
    def _agree(group: tuple[int, ...], tensors: list, describe_call) -> None:
        """Raise as every member of a process group would when the members' calls (shapes,
        dtypes) differ; ``describe_call(r)``: member r's call, worked out only then."""
        first = tensors[group[0]]
        if any(not _alike(tensors[r], first) for r in group[1:]):
            descs = {r: describe_call(r) for r in group}
            if len(set(descs.values())) > 1:
                raise disagreement(f"a collective over group {list(group)}", descs)

    def all_reduce(self, ts: list, axes: Sequence[int], op: str = "sum") -> list[torch.Tensor]:
        """Each rank's ``op`` over its group of ``ts``: a new tensor on every rank."""
        for t in ts:
            _check_tensor(t, "all_reduce")
        _check_op(op, "all_reduce")
        out: list = [None] * len(ts)
        for group in self._groups("all_reduce", axes, ts, _nbytes):
            self._agree(group, ts, lambda r: f"all_reduce(op={op}) over axes {tuple(axes)}: {describe(ts[r])}")
            total = reduce_tensors([ts[r].detach() for r in group], op)
            for r in group[:-1]:
                out[r] = total.clone()
            out[group[-1]] = total
        return out

    def all_gather(self, ts: list, axes: Sequence[int]) -> list[list[torch.Tensor]]:
        """Each rank's group's tensors, in group order, copies of their own."""
        for t in ts:
            _check_tensor(t, "all_gather")
        out: list = [None] * len(ts)
        for group in self._groups("all_gather", axes, ts, _nbytes):
            self._agree(group, ts, lambda r: f"all_gather over axes {tuple(axes)}: {describe(ts[r])}")
            for r in group:
                out[r] = [ts[m].detach().clone() for m in group]
        return out

    def all_to_all(self, chunk_lists: list, axes: Sequence[int]) -> list[list[torch.Tensor]]:
        """Rank r's result j is chunk (r's position) of its group's member j."""
        out: list = [None] * len(chunk_lists)
        size = len(_partition(self.mesh, tuple(axes))[1][0])   # every group over the axes is this large
        chunk_lists = [_check_chunks(chunks, size, "all_to_all") for chunks in chunk_lists]
        for group in self._groups("all_to_all", axes, chunk_lists, lambda cs: sum(_nbytes(c) for c in cs)):
            self._agree(group, chunk_lists,
                        lambda r: f"all_to_all over axes {tuple(axes)}: {[describe(c) for c in chunk_lists[r]]}")
            for position, r in enumerate(group):
                out[r] = [chunk_lists[m][position].detach().clone() for m in group]
        return out


class RanksAtOnce:
    """Every rank of an :class:`AllRanks` as one holder of one tensor: each tensor passed in holds
    every rank's, stacked on a new leading dim in rank order (the strategy check of an even
    layout, ``verify/together.py``), so a pattern of ``collectives.patterns`` runs once for all
    ranks.  Only the all-reduce is offered: each rank's row is reduced over its group in group
    order, as :func:`reduce_tensors` reduces (bit-identical results), and every rank's
    communicator counts the call and the bytes of its row, as its own collective would."""

    def __init__(self, ranks: AllRanks) -> None:
        self.mesh = ranks.mesh
        self.ranks = ranks
        self.comms = ranks.comms[:1]   # a pattern asks the first for its group's size: every rank's is alike

    def all_reduce(self, ts: list, axes: Sequence[int], op: str = "sum") -> list[torch.Tensor]:
        _check_op(op, "all_reduce")
        if len(ts) != 1 or not isinstance(ts[0], torch.Tensor) or ts[0].dim() == 0 or \
                ts[0].shape[0] != len(self.ranks.comms):
            raise CollectiveError(f"an all-reduce over every rank at once takes one tensor of the "
                                  f"{len(self.ranks.comms)} ranks' stacked, got "
                                  f"{[describe(t) if isinstance(t, torch.Tensor) else type(t).__name__ for t in ts]}")
        t = ts[0].detach()
        shape, local = tuple(self.mesh.shape), tuple(t.shape[1:])
        self.ranks._groups("all_reduce", axes, list(t), _nbytes)   # each rank counts its row, as its own call
        checked, _ = _partition(self.mesh, tuple(axes))
        others = [a for a in range(len(shape)) if a not in checked]
        moved = t.reshape(shape + local).permute(list(checked) + others + list(range(len(shape), len(shape) + len(local))))
        members = moved.reshape((math.prod(shape[a] for a in checked), -1)).unbind(0)   # each group's rows in group order
        total = reduce_tensors(members, op)
        kept = [1 if a in checked else shape[a] for a in range(len(shape))]
        return [total.reshape(kept + list(local)).expand(shape + local).reshape(t.shape)]

    def _refuse(self, *args) -> None:
        raise CollectiveError("only the all-reduce runs over every rank at once; check this layout rank by rank")

    all_gather = all_to_all = _refuse


def _alike(one, other) -> bool:
    """Whether two members' payloads (a tensor, or a list of chunks) have the same shapes and dtypes."""
    if isinstance(one, torch.Tensor):
        return one.shape == other.shape and one.dtype == other.dtype
    return len(one) == len(other) and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(one, other))


@functools.lru_cache(maxsize=256)
def _partition(mesh: DeviceMesh, axes: tuple) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The validated ``axes`` and the groups of ``mesh``'s ranks over them, each in group order."""
    checked = mesh.check_axes(axes)
    return checked, tuple(dict.fromkeys(mesh.group_ranks(rank, checked) for rank in range(mesh.size)))
