"""The rank side of the real backends: torch.distributed process groups per mesh-axes set,
and the communicator that maps mesh-ordered collectives onto them.

Shared by the persistent worker pool (``process.py``) and torchrun worlds (``torchrun.py``).
torch sorts the ranks of a new group, so one process group serves every ordering of the
same axes (``(0, 1)`` and ``(1, 0)``); the communicator permutes between group order
(``mesh.group_ranks``) and process-group order.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardverify.backends.agreement import SharedAgreement
from shardverify.backends.base import CommunicatorBase, describe, disagreement, p2p_mismatch
from shardverify.errors import CollectiveError
from shardverify.sharding.mesh import DeviceMesh

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
#: bytes of the metadata header every member contributes before a checked collective
HEADER_BYTES = 128
_DIGEST = 8


@dataclass(frozen=True)
class MeshGroups:
    """This rank's process group for every non-empty set of mesh axes."""

    by_axes: dict[frozenset[int], Any]
    lookups: dict = field(default_factory=dict)   # group in mesh order -> (process group, order)

    def get(self, axes: Sequence[int]) -> Any:
        return self.by_axes[frozenset(axes)]


def build_groups(mesh: DeviceMesh, rank: int) -> MeshGroups:
    """Create the process groups of every axes subset; a collective call on every rank.

    Every rank creates every group in the same order (``new_group`` needs all ranks);
    a group spanning the whole world reuses the default group.
    """
    mine: dict[frozenset[int], Any] = {}
    for count in range(1, mesh.ndim + 1):
        for axes in itertools.combinations(range(mesh.ndim), count):
            for members in mesh.groups(axes):
                if len(members) == mesh.size:
                    pg = dist.group.WORLD
                else:
                    pg = dist.new_group(sorted(members))
                if rank in members:
                    mine[frozenset(axes)] = pg
    return MeshGroups(mine)


def encode_header(desc: str, device: torch.device) -> torch.Tensor:
    """A fixed-size byte header: a digest of ``desc`` then its (truncated) text."""
    raw = desc.encode()
    data = hashlib.blake2b(raw, digest_size=_DIGEST).digest() + raw[: HEADER_BYTES - _DIGEST]
    return torch.tensor(list(data.ljust(HEADER_BYTES, b"\0")), dtype=torch.uint8, device=device)


def decode_header(header: torch.Tensor) -> str:
    text = bytes(header.cpu().tolist())[_DIGEST:].rstrip(b"\0").decode(errors="replace")
    return text if len(text) < HEADER_BYTES - _DIGEST else text + "..."


class ProcessCommunicator(CommunicatorBase):
    """One rank of a torch.distributed world laid out as ``mesh``.

    With ``check_metadata`` every collective first agrees on a digest of each member's call
    (kind, axes, op, dtype, shapes) with one small all-reduce; on a mismatch the members
    all-gather 128-byte headers describing their calls and raise CollectiveError on every
    member instead of hanging or mixing bytes.  Turn it off only for benchmarks.
    ``busy`` (a shared byte array, optional) records which ranks sit inside a collective, so
    the pool can tell a hung rank from the ranks waiting for it.
    """

    def __init__(self, mesh: DeviceMesh, rank: int, device: torch.device | str, groups: MeshGroups,
                 *, check_metadata: bool = True, native_reduce_scatter: bool = False, busy: Any = None,
                 where: Any = None, agreement: SharedAgreement | None = None, check: int = 0) -> None:
        super().__init__(mesh, rank, device)
        self.groups = groups
        self.check_metadata = check_metadata
        self.native_reduce_scatter = native_reduce_scatter
        self._busy = busy
        self._where = where if mesh.size < 63 else None   # member bitmasks must fit an int64
        # a pool's shared memory agrees on calls without a collective (see agreement.py);
        # ``check`` (unique per pool) keeps one check's calls apart from the next one's
        self._agreement = agreement if mesh.size < 63 else None
        self._check = check
        self._agreed: collections.Counter = collections.Counter()   # per member set: n-th agreement
        self._calls: collections.Counter = collections.Counter()   # per member set: n-th collective
        self._pgs: dict[tuple[int, ...], tuple[Any, list[int]]] = groups.lookups   # shared by this rank's checks

    def process_group(self, axes: Sequence[int]) -> Any:
        """The real process group over ``axes`` (ranks sorted), e.g. for DDP."""
        axes = self.mesh.check_axes(axes)
        if not axes:
            raise CollectiveError("process_group needs at least one mesh axis, got ()")
        return self.groups.get(axes)

    # ---- plumbing -----------------------------------------------------------------------
    def _pg(self, group: tuple[int, ...]) -> tuple[Any, list[int]]:
        """The process group and, for each process-group rank, its index in ``group``."""
        found = self._pgs.get(group)
        if found is None:
            axes = [a for a in range(self.mesh.ndim)
                    if len({self.mesh.coordinate(r)[a] for r in group}) > 1]
            order = sorted(range(len(group)), key=lambda i: group[i])
            found = self._pgs[group] = (self.groups.get(axes), order)
        return found

    def _enter(self, group: tuple[int, ...] = ()) -> None:
        if self._where is not None:   # which collective: what a timeout report names
            mask = sum(1 << r for r in group)
            self._calls[mask] += 1
            self._where[2 * self.rank], self._where[2 * self.rank + 1] = mask, self._calls[mask]
        if self._busy is not None:
            self._busy[self.rank] = 1

    def _leave(self) -> None:
        if self._busy is not None:
            self._busy[self.rank] = 0

    def _agree(self, pg: Any, group: tuple[int, ...], desc: str) -> None:
        """Every member's call must be the same: one small all-reduce (max) of this call's
        digest and its negation gives the largest and smallest digest of the group, equal
        only when every member made the same call (in a pool, the shared-memory agreement
        compares the digests and tells every member instead).  Otherwise every member sees
        it, and all exchange their headers to say who called what."""
        if not self.check_metadata:
            return
        digest = int.from_bytes(hashlib.blake2b(desc.encode(), digest_size=7).digest(), "big")
        if self._agreement is not None:
            members = tuple(sorted(group))
            self._agreed[members] += 1
            if self._agreement.agree(self.rank, members, self._check, self._agreed[members], digest):
                return
        else:
            probe = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)
            dist.all_reduce(probe, dist.ReduceOp.MAX, group=pg)
            high, low = probe.tolist()
            if high == digest == -low:
                return
        header = encode_header(desc, self.device)
        headers = [torch.empty_like(header) for _ in group]
        dist.all_gather(headers, header, group=pg)
        descs = dict(zip(sorted(group), (decode_header(h) for h in headers)))
        raise disagreement(f"a collective over group {sorted(group)}", descs)

    def _collective(self, group, desc, body):
        pg, order = self._pg(group)
        self._enter(group)
        try:
            self._agree(pg, group, desc)
            return body(pg, order)
        finally:
            self._leave()

    def _empty(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)

    # ---- transport ----------------------------------------------------------------------
    def _all_reduce(self, t, group, op, desc):
        def body(pg, order):
            out = t.detach().clone(memory_format=torch.contiguous_format)
            dist.all_reduce(out, _REDUCE_OPS[op], group=pg)
            return out

        return self._collective(group, desc, body)

    def _all_gather(self, t, group, desc):
        def body(pg, order):
            outs = [self._empty(t) for _ in group]
            dist.all_gather(outs, t.detach().contiguous(), group=pg)
            result = [None] * len(group)
            for pg_rank, index in enumerate(order):
                result[index] = outs[pg_rank]
            return result

        return self._collective(group, desc, body)

    def _reduce_scatter(self, chunks, group, op, desc):
        index = group.index(self.rank)

        def body(pg, order):
            same = len({tuple(c.shape) for c in chunks}) == 1
            if self.native_reduce_scatter and same:
                out = self._empty(chunks[index])
                inputs = [chunks[i].detach().contiguous() for i in order]
                dist.reduce_scatter(out, inputs, _REDUCE_OPS[op], group=pg)
                return out
            # gloo has no reduce_scatter: all-reduce the concatenation, keep our segment
            flat = torch.cat([c.detach().reshape(-1) for c in chunks])
            dist.all_reduce(flat, _REDUCE_OPS[op], group=pg)
            start = sum(c.numel() for c in chunks[:index])
            return flat[start:start + chunks[index].numel()].reshape(chunks[index].shape).clone()

        return self._collective(group, desc, body)

    def _all_to_all(self, chunks, group, desc):
        index = group.index(self.rank)

        def body(pg, order):
            inputs = [chunks[i].detach().contiguous() for i in order]
            outs = [self._empty(chunks[index]) for _ in group]   # shapes agree (checked)
            dist.all_to_all(outs, inputs, group=pg)
            result = [None] * len(group)
            for pg_rank, i in enumerate(order):
                result[i] = outs[pg_rank]
            return result

        return self._collective(group, desc, body)

    def _broadcast(self, t, group, src, desc):
        def body(pg, order):
            out = t.detach().clone(memory_format=torch.contiguous_format) if group[src] == self.rank \
                else self._empty(t)
            dist.broadcast(out, src=group[src], group=pg)
            return out

        return self._collective(group, desc, body)

    def _barrier(self, group, desc):
        def body(pg, order):
            dist.all_reduce(torch.zeros(1, device=self.device), group=pg)

        self._collective(group, desc, body)

    # point to point: with check_metadata the receiver answers the sender's header with its
    # own expectation, so both sides raise on a mismatch before the payload moves
    def _send(self, t, dst):
        self._enter()
        try:
            if self.check_metadata:
                header = encode_header(describe(t), self.device)
                dist.send(header, dst)
                answer = torch.empty_like(header)
                dist.recv(answer, dst)
                if not torch.equal(answer, header):
                    raise p2p_mismatch(self.rank, dst, describe(t), decode_header(answer))
            dist.send(t.detach().contiguous(), dst)
        finally:
            self._leave()

    def _recv(self, like, src):
        self._enter()
        try:
            if self.check_metadata:
                expected = encode_header(describe(like), self.device)
                header = torch.empty_like(expected)
                dist.recv(header, src)
                dist.send(expected, src)
                if not torch.equal(header, expected):
                    raise p2p_mismatch(src, self.rank, decode_header(header), describe(like))
            out = self._empty(like)
            dist.recv(out, src)
            return out
        finally:
            self._leave()


__all__ = ["HEADER_BYTES", "MeshGroups", "ProcessCommunicator", "build_groups", "decode_header",
           "encode_header"]
