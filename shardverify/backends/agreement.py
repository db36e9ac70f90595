"""Call agreement through shared memory, for the workers of one process pool.

Before a checked collective moves its payload, every member must have made the same call
(kind, axes, op, dtype, shapes): otherwise a real backend may hang, fail on some ranks only,
or mix bytes.  Over torch.distributed alone that agreement costs one extra small all-reduce
per collective, which on gloo is as slow as the payload's own (each hop wakes a process and
its gloo threads).  The pool's workers share memory, so they agree there instead: each
member publishes (check, member set, call number, digest of its call) and waits until every
member has published the same call, woken by the last to arrive, which compares the digests
and hands every member the verdict.  The outcome is the same as the all-reduce's: before
any payload moves, every member knows whether every member made its call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: int64 fields per rank slot: check sequence number, member bitmask, call number, digest
_FIELDS = 4


class SharedAgreement:
    """Slots, a lock and one wake-up semaphore per rank, created by the pool's parent and
    inherited by every worker at start (multiprocessing primitives)."""

    def __init__(self, ctx: Any, world: int) -> None:
        self.lock = ctx.Lock()
        self.wake = [ctx.Semaphore(0) for _ in range(world)]
        self.slots = ctx.RawArray("q", _FIELDS * world)
        self.verdicts = ctx.RawArray("b", world)   # per rank: 1 when its last agreement found every call alike

    def agree(self, rank: int, group: Sequence[int], check: int, call: int, digest: int) -> bool:
        """Publish this rank's call (``call``-th collective of ``check`` on the member set
        ``group``), wait for every member to publish the same call, and say whether every
        member's digest equals this rank's.

        The last member to arrive compares the digests under the lock and hands every member
        its verdict before waking it: a member's slot may change as soon as it is woken (a
        broadcast's source, say, returns before its receivers and publishes its next call),
        and a verdict slot only changes at its own rank's next agreement.  Waits without a
        time limit: a member that never arrives is a hang, which the pool's parent times out
        and answers by killing every worker."""
        mask = 0
        for member in group:
            mask |= 1 << member
        slots, me = self.slots, _FIELDS * rank
        with self.lock:
            slots[me], slots[me + 1], slots[me + 2], slots[me + 3] = check, mask, call, digest
            arrived = all(slots[_FIELDS * m] == check and slots[_FIELDS * m + 1] == mask
                          and slots[_FIELDS * m + 2] == call for m in group)
            if arrived:
                alike = int(all(slots[_FIELDS * m + 3] == digest for m in group))
                for member in group:
                    self.verdicts[member] = alike
                    if member != rank:
                        self.wake[member].release()
        if not arrived:
            self.wake[rank].acquire()
        return bool(self.verdicts[rank])
