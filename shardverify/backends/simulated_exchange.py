"""The exchange of the simulated mesh: the turn every rank thread waits for (one runs at a time),
the rendezvous each collective and point-to-point call is (every member deposits its payload and
call and waits for the group; the last to arrive computes everybody's result), and :class:`SimulatedCommunicator`, the
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

    def meet(self, key: tuple, group: tuple[int, ...], rank: int, desc: str, payload: Any,
             results: Callable[[list[Any]], list[Any]]) -> Any:
        """Deposit, wait for the group, return this member's result.

        The last member to arrive checks that all made the same call and computes every
        member's result at once (``results(payloads in group order)``, in group order).  No
        member has left the collective yet, so no input can have changed since it was
        deposited: the payloads are the ranks' own tensors, never snapshots, and are dropped
        as soon as the results exist.  A result every member gets alike (an all-reduce's sum)
        is computed once (:class:`_Shared`): each member copies it when it takes it and the last
        takes it itself, so members that free their result before the next one runs (a
        gradient compared and dropped) never hold all copies at once.
        """
        with self.lock:
            if self.aborted:
                raise _Aborted()
            slot = self.slots.setdefault(key, {})
            slot[rank] = (desc, payload)
            if len(slot) == len(group):
                slot["done"] = _settle([slot.pop(r) for r in group], group, results)
            self.entered[rank] = (key, group, desc)
            try:
                self._wait(rank, lambda: "done" in slot)
            finally:
                self.entered.pop(rank, None)
            descs, outs = slot["done"]
            self.reads[key] += 1
            last = self.reads[key] == len(group)
            if last:
                del self.slots[key], self.reads[key]
            mine = outs[group.index(rank)] if isinstance(outs, list) else None
            if isinstance(outs, list):
                outs[group.index(rank)] = None   # the slot keeps no reference to a taken result
            if isinstance(mine, _Shared):
                mine = mine.take(last)
        if len(set(descs.values())) > 1:
            raise disagreement(f"a collective over group {list(group)}", descs)
        if isinstance(outs, BaseException):
            raise outs
        return mine

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

    def _meet(self, group: tuple[int, ...], desc: str, payload: Any,
              results: Callable[[list[Any]], list[Any]]) -> Any:
        members = tuple(sorted(group))   # same rank set = same process group, as on real backends
        self._calls[members] += 1
        return self._exchange.meet((members, self._calls[members]), group, self.rank, desc, payload, results)

    def _all_reduce(self, t, group, op, desc):
        def results(ts):
            return [_Shared(reduce_tensors(ts, op))] * len(ts)
        return self._meet(group, desc, t.detach(), results)

    def _all_gather(self, t, group, desc):
        return self._meet(group, desc, t.detach(), lambda ts: [_Shared([x.clone() for x in ts])] * len(ts))

    def _reduce_scatter(self, chunks, group, op, desc):
        def results(lists):
            return [reduce_tensors([chunk_list[i] for chunk_list in lists], op) for i in range(len(lists))]
        return self._meet(group, desc, [c.detach() for c in chunks], results)

    def _all_to_all(self, chunks, group, desc):
        def results(lists):
            return [[chunk_list[i].clone() for chunk_list in lists] for i in range(len(lists))]
        return self._meet(group, desc, [c.detach() for c in chunks], results)

    def _broadcast(self, t, group, src, desc):
        payload = t.detach() if group[src] == self.rank else None
        return self._meet(group, desc, payload, lambda ps: [_Shared(ps[src].clone())] * len(ps))

    def _barrier(self, group, desc):
        self._meet(group, desc, None, lambda ps: [None for _ in ps])

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


class _Shared:
    """One result every member of a collective gets: copied for each member that takes it but
    the last, which takes the value itself (every result is still a tensor no other rank holds)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def take(self, last: bool) -> Any:
        if last:
            return self.value
        if isinstance(self.value, list):
            return [t.clone() for t in self.value]
        return self.value.clone()


def _settle(entries: list[tuple[str, Any]], group: tuple[int, ...],
            results: Callable[[list[Any]], list[Any]]) -> tuple[dict[int, str], Any]:
    """Every member's call, and every member's result (or the error computing them raised,
    which each member re-raises): nothing is computed for calls that disagree."""
    descs = {r: desc for r, (desc, _) in zip(group, entries)}
    if len(set(descs.values())) > 1:
        return descs, None
    try:
        return descs, results([payload for _, payload in entries])
    except Exception as exc:  # every member raises it, none waits forever
        return descs, exc
