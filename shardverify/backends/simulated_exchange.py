"""The exchange of the simulated mesh: the turn every rank thread waits for (one runs at a time),
the rendezvous each collective and point-to-point call is (every member deposits its payload and
call, waits for the group, reads everybody's payload), and :class:`SimulatedCommunicator`, the
rank's side of it. :mod:`shardverify.backends.simulated` runs the threads."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import torch

from shardverify.backends.base import CommunicatorBase, describe, disagreement, p2p_mismatch, reduce_tensors
from shardverify.sharding.mesh import DeviceMesh

__all__ = ["SimulatedCommunicator"]


class _Aborted(BaseException):
    """Unwinds a rank blocked in a collective once the run failed (not an ``Exception``,
    so a check's own ``except Exception`` cannot swallow it)."""


class _Letter:
    """One point-to-point message waiting for its receiver."""

    __slots__ = ("data", "desc", "error", "taken")   # error: what the receiver expected instead

    def __init__(self, data: torch.Tensor, desc: str) -> None:
        self.data, self.desc = data, desc
        self.error: str | None = None
        self.taken = False


class _Turns:
    """Who may run: only the rank holding the turn does.

    It keeps the turn until it must wait (a collective whose members have not all arrived,
    a send not yet received, a receive with nothing posted) or its task ends; then the turn
    goes to the next rank, in rank order, whose wait is over.  Each rank sleeps on its own
    condition, so a hand-over wakes exactly one thread.  One ``_Turns`` serves every check
    of a batch; each check has its own ``_Exchange``.
    """

    def __init__(self, world: int) -> None:
        self.lock = threading.Lock()
        self.conds = [threading.Condition(self.lock) for _ in range(world)]
        self.blocked: dict[int, Callable[[], bool]] = {}   # rank -> what it waits for
        self.waiting: set[int] = set()   # ranks blocked in a collective (or for the turn) right now
        self.holder: int | None = None   # the rank whose turn it is to run
        self.world = world

    def wake_all(self) -> None:
        """Lock held: let every sleeping rank look at its exchange again (after an abort)."""
        for cond in self.conds:
            cond.notify_all()

    def _pass(self, rank: int) -> None:
        """Hand the turn (held by ``rank``, lock held) to the next rank whose wait is over."""
        self.holder = None
        for step in range(1, self.world + 1):
            other = (rank + step) % self.world
            ready = self.blocked.get(other)
            if ready is not None and ready():
                self.holder = other
                self.conds[other].notify()
                return

    def wait(self, rank: int, ready: Callable[[], bool], exchange: Any) -> None:
        """Block (lock held) until ``ready()`` and this rank's turn; unwinds when ``exchange``
        (an _Exchange, or a _Batch between checks) is aborted."""
        def over() -> bool:
            return ready() or (exchange is not None and exchange.aborted)

        if exchange is not None and exchange.aborted:
            raise _Aborted()
        if self.holder in (None, rank) and ready():
            self.holder = rank
            return
        self.blocked[rank] = over
        self.waiting.add(rank)
        try:
            if self.holder in (rank, None):   # nobody else runs: wake whoever can go on
                self._pass(rank)
            while True:
                if exchange is not None and exchange.aborted:
                    if self.holder == rank:
                        self._pass(rank)
                    raise _Aborted()
                if self.holder == rank:
                    break
                if self.holder is None and over():
                    self.holder = rank
                    continue
                self.conds[rank].wait()
        finally:
            del self.blocked[rank]
            self.waiting.discard(rank)

    def take(self, rank: int) -> None:
        """Wait for this rank's turn (before its tasks run)."""
        with self.lock:
            self.wait(rank, lambda: True, None)

    def release(self, rank: int) -> None:
        with self.lock:
            if self.holder == rank:
                self._pass(rank)


class _Exchange:
    """The rendezvous of one check: collective slots, mailboxes, abort flag."""

    def __init__(self, turns: _Turns) -> None:
        self.turns = turns
        self.lock = turns.lock
        self.slots: dict[tuple, dict[int, tuple[str, Any]]] = {}
        self.reads: collections.Counter = collections.Counter()
        self.mail: dict[tuple[int, int], collections.deque[_Letter]] = collections.defaultdict(collections.deque)
        self.entered: dict[int, tuple] = {}   # rank -> (slot key, group, desc) of the collective it waits in
        self.aborted = False

    def abort(self) -> None:
        with self.lock:
            self.aborted = True
            self.turns.wake_all()

    def _wait(self, rank: int, ready: Callable[[], bool]) -> None:
        self.turns.wait(rank, ready, self)

    def gather(self, key: tuple, group: tuple[int, ...], rank: int, desc: str, payload: Any) -> list[Any]:
        """Deposit, wait for the group, return every payload in group order (after
        checking that all members made the same call)."""
        with self.lock:
            if self.aborted:
                raise _Aborted()
            slot = self.slots.setdefault(key, {})
            slot[rank] = (desc, payload)
            self.entered[rank] = (key, group, desc)
            try:
                self._wait(rank, lambda: len(slot) == len(group))
            finally:
                self.entered.pop(rank, None)
            entries = [slot[r] for r in group]
            self.reads[key] += 1
            if self.reads[key] == len(group):
                del self.slots[key], self.reads[key]
        descs = {r: entry[0] for r, entry in zip(group, entries)}
        if len(set(descs.values())) > 1:
            raise disagreement(f"a collective over group {list(group)}", descs)
        return [entry[1] for entry in entries]

    def post(self, src: int, dst: int, letter: _Letter) -> None:
        with self.lock:
            if self.aborted:
                raise _Aborted()
            self.mail[(src, dst)].append(letter)
            self._wait(src, lambda: letter.taken)

    def take(self, src: int, dst: int, check: Callable[[_Letter], str | None]) -> _Letter:
        with self.lock:
            box = self.mail[(src, dst)]
            self._wait(dst, lambda: bool(box))
            letter = box.popleft()
            letter.error = check(letter)
            letter.taken = True
            return letter

    def never_entered(self) -> tuple[tuple[int, ...], str]:
        """For a timeout (lock held): the members of the collectives ranks wait in that never
        entered them, and a text naming both sides."""
        lines, absent = [], set()
        for key, group, desc in sorted({(k, g, d) for k, g, d in self.entered.values()}, key=repr):
            inside = sorted(r for r, (k, _, _) in self.entered.items() if k == key)
            missing = sorted(r for r in group if r not in inside)
            absent.update(missing)
            if missing:
                lines.append(f"rank(s) {inside} wait in {desc} (call {key[1]} on group {list(key[0])}); "
                             f"rank(s) {missing} never entered it")
        return tuple(sorted(absent)), "; ".join(lines)


class SimulatedCommunicator(CommunicatorBase):
    """One rank of a simulated run; every result is a tensor no other rank holds."""

    def __init__(self, mesh: DeviceMesh, rank: int, device: torch.device | str, exchange: _Exchange) -> None:
        super().__init__(mesh, rank, device)
        self._exchange = exchange
        self._calls: collections.Counter = collections.Counter()  # per rank set: n-th collective

    def _gather(self, group: tuple[int, ...], desc: str, payload: Any) -> list[Any]:
        """Exchange snapshots (clones), so a rank may modify its input as soon as it returns."""
        members = tuple(sorted(group))   # same rank set = same process group, as on real backends
        self._calls[members] += 1
        return self._exchange.gather((members, self._calls[members]), group, self.rank, desc, payload)

    def _all_reduce(self, t, group, op, desc):
        return reduce_tensors(self._gather(group, desc, _snapshot(t)), op)

    def _all_gather(self, t, group, desc):
        return [x.clone() for x in self._gather(group, desc, _snapshot(t))]

    def _reduce_scatter(self, chunks, group, op, desc):
        index = group.index(self.rank)
        lists = self._gather(group, desc, [_snapshot(c) for c in chunks])
        return reduce_tensors([chunk_list[index] for chunk_list in lists], op)

    def _all_to_all(self, chunks, group, desc):
        index = group.index(self.rank)
        lists = self._gather(group, desc, [_snapshot(c) for c in chunks])
        return [chunk_list[index].clone() for chunk_list in lists]

    def _broadcast(self, t, group, src, desc):
        payload = _snapshot(t) if group[src] == self.rank else None
        return self._gather(group, desc, payload)[src].clone()

    def _barrier(self, group, desc):
        self._gather(group, desc, None)

    def _send(self, t, dst):
        letter = _Letter(t.detach().clone(), describe(t))
        self._exchange.post(self.rank, dst, letter)
        if letter.error is not None:
            raise p2p_mismatch(self.rank, dst, letter.desc, letter.error)

    def _recv(self, like, src):
        expected = describe(like)
        letter = self._exchange.take(src, self.rank, lambda l: None if l.desc == expected else expected)
        if letter.error is not None:
            raise p2p_mismatch(src, self.rank, letter.desc, expected)
        return letter.data


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()
