"""The simulated mesh stepped in one thread: every rank of a check is a generator (its SPMD
function written as steps, :mod:`shardverify.backends.steps`), run until it waits in a collective;
when the last member of a collective arrives, every member's result is computed at once (the same
rendezvous as :mod:`shardverify.backends.simulated_exchange`: calls agree or every member raises,
each member gets a tensor no other rank holds) and the members go on.  No thread hand-over per
collective: on a machine other work keeps busy, each hand-over was a chance to wait for a core.

Ranks run in the order the threaded mesh gives them its turn: a rank runs until it waits; the last
member to arrive goes on at once, the others after the ranks already waiting to run.  A failing
rank ends its check: the ranks waiting in a collective, and those that reach one later, stop there
(reported as aborted, as on the threaded mesh).  Ranks that all wait in collectives some member
never enters are a deadlock, found at once rather than at the timeout.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardverify.backends.base import CommunicatorBase, RankResult, disagreement, reduce_tensors
from shardverify.backends.simulated_exchange import _settle, _Shared
from shardverify.backends.steps import Pending
from shardverify.errors import BackendError
from shardverify.sharding.mesh import DeviceMesh

__all__ = ["SteppedCommunicator", "step_check", "Deadlock"]


class SteppedCommunicator(CommunicatorBase):
    """One rank of a stepped check: each collective (validated and counted as on any transport)
    comes back as a :class:`Pending` for the rank to yield."""

    def __init__(self, mesh: DeviceMesh, rank: int, device: torch.device | str) -> None:
        super().__init__(mesh, rank, device)
        self._calls: collections.Counter = collections.Counter()   # per member set: n-th collective

    def _pending(self, group: tuple[int, ...], desc: str, payload: Any,
                 results: Callable[[list[Any]], list[Any]]) -> Pending:
        members = tuple(sorted(group))   # same rank set = same process group, as on real backends
        self._calls[members] += 1
        return Pending((members, self._calls[members]), group, desc, payload, results)

    def _all_reduce(self, t, group, op, desc):
        return self._pending(group, desc, t.detach(), lambda ts: [_Shared(reduce_tensors(ts, op))] * len(ts))

    def _all_gather(self, t, group, desc):
        return self._pending(group, desc, t.detach(), lambda ts: [_Shared([x.clone() for x in ts])] * len(ts))

    def _reduce_scatter(self, chunks, group, op, desc):
        def results(lists):
            return [reduce_tensors([chunk_list[i] for chunk_list in lists], op) for i in range(len(lists))]
        return self._pending(group, desc, [c.detach() for c in chunks], results)

    def _all_to_all(self, chunks, group, desc):
        def results(lists):
            return [[chunk_list[i].clone() for chunk_list in lists] for i in range(len(lists))]
        return self._pending(group, desc, [c.detach() for c in chunks], results)

    def _broadcast(self, t, group, src, desc):
        payload = t.detach() if group[src] == self.rank else None
        return self._pending(group, desc, payload, lambda ps: [_Shared(ps[src].clone())] * len(ps))

    def _barrier(self, group, desc):
        return self._pending(group, desc, None, lambda ps: [None for _ in ps])

    def _send(self, t, dst):
        raise BackendError("point-to-point send is not stepped: run this function on the threaded simulated mesh")

    def _recv(self, like, src):
        raise BackendError("point-to-point recv is not stepped: run this function on the threaded simulated mesh")


class Deadlock:
    """Ranks left waiting in collectives that some member never entered: who waits where."""

    def __init__(self, waiting: dict[int, Pending]) -> None:
        self.ranks = tuple(sorted(waiting))
        lines, absent = [], set()
        for key in sorted({p.key for p in waiting.values()}, key=repr):
            inside = sorted(r for r, p in waiting.items() if p.key == key)
            first = waiting[inside[0]]
            missing = sorted(r for r in first.group if r not in inside)
            absent.update(missing)
            lines.append(f"rank(s) {inside} wait in {first.desc} (call {key[1]} on group {list(key[0])}); "
                         f"rank(s) {missing} never entered it")
        self.never_entered = tuple(sorted(absent))
        self.detail = "; ".join(lines) + " (a deadlock, found when no rank could go on)"


def step_check(steps: Callable[..., Any], mesh: DeviceMesh, device: torch.device, rank_args: Sequence[tuple],
               finish: Callable[[int, RankResult | None], None], cancelled: Callable[[], bool]) -> Deadlock | None:
    """Run one check, ``steps(comm, *rank_args[rank])`` on every rank, in this thread, calling
    ``finish(rank, result)`` for each rank (None: aborted after another rank failed, or left in a
    deadlock).  Returns the deadlock, if the ranks ended in one."""
    gens = {rank: steps(SteppedCommunicator(mesh, rank, device), *args) for rank, args in enumerate(rank_args)}
    ready: collections.deque = collections.deque((rank, None, None) for rank in gens)
    slots: dict[tuple, dict[int, Pending]] = {}
    waiting: dict[int, Pending] = {}
    failed = False
    while ready:
        if cancelled():
            for gen in gens.values():
                gen.close()
            return None
        rank, value, error = ready.popleft()
        gen = gens[rank]
        try:
            pending = gen.throw(error) if error is not None else gen.send(value)
        except StopIteration as stop:
            finish(rank, RankResult(rank, True, stop.value))
            continue
        except BaseException as exc:  # noqa: BLE001 - reported to the caller as RankError
            finish(rank, RankResult.failure(rank, exc))
            if not failed:   # the others stop where they wait, or at their next collective
                failed = True
                for other in sorted(waiting):
                    gens[other].close()
                    finish(other, None)
                waiting.clear()
            continue
        if not isinstance(pending, Pending):
            ready.appendleft((rank, None, BackendError(f"a stepped rank yielded {pending!r}, not a collective")))
            continue
        if failed:
            gen.close()
            finish(rank, None)
            continue
        slot = slots.setdefault(pending.key, {})
        slot[rank] = pending
        waiting[rank] = pending
        if len(slot) < len(pending.group):
            continue
        del slots[pending.key]
        group = pending.group
        descs, outs = _settle([(slot[r].desc, slot[r].payload) for r in group], group, pending.results)
        woken = []
        for position, member in enumerate(group):
            del waiting[member]
            if len(set(descs.values())) > 1:
                woken.append((member, None, disagreement(f"a collective over group {list(group)}", descs)))
            elif isinstance(outs, BaseException):
                woken.append((member, None, outs))
            else:
                mine = outs[position]
                outs[position] = None
                if isinstance(mine, _Shared):
                    mine = mine.take(position == len(group) - 1)
                woken.append((member, mine, None))
        mine = next(w for w in woken if w[0] == rank)   # the last to arrive goes on at once
        ready.extend(w for w in woken if w[0] != rank)
        ready.appendleft(mine)
    if waiting:
        deadlock = Deadlock(waiting)
        for rank in sorted(waiting):
            gens[rank].close()
            finish(rank, None)
        return deadlock
    return None
