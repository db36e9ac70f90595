"""The simulated mesh: every rank is a thread of this process, sharing one exchange; a function
that offers a form over all ranks at once (the strategy check) runs in that form instead, every
rank in one thread (backends/stacked.py).

Collectives are rendezvous: each member deposits its payload and the description of its
call, waits for the whole group, then reads everybody's payload and computes its own
result, so the semantics (blocking, group order, agreement) match real process groups and
the same SPMD code runs on both.  Point-to-point sends block until received, as on gloo.

Only one rank runs at a time: a rank holds the turn until it blocks in a collective or ends,
then the next runnable rank takes it.  The ranks share one GIL anyway; letting them all run
would only make every tensor op (each releases the GIL) a thread switch.

Each rank thread disables autograd's multithreaded backward for itself, so the backward of
a differentiable collective runs on the rank's own thread, even for CUDA tensors (the
engine's shared device threads would otherwise deadlock waiting for the other ranks).

Since one rank runs at a time, the rank threads are kept on the CPU the calling thread runs
on (Linux; re-chosen per batch, so they follow the caller wherever the OS moves it), and so is
the caller until the batch ends: a hand-over to a thread sleeping on another, idle core waits
for that core to wake, which on a check of small tensors costs a third of the check.  Kept on
one CPU, a rank runs its ops with one intra-op thread; spread, with the caller's count.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from shardverify.backends.base import BatchBackend, RankResult, check_fn, check_timeout, private_copy
from shardverify.backends.cpus import can_keep, keep_to_cpu
from shardverify.errors import BackendError, RankTimeout
from shardverify.backends.simulated_exchange import SimulatedCommunicator, _Aborted, _Exchange, _Turns
from shardverify.backends.stacked import AllRanks
from shardverify.sharding.mesh import DeviceMesh

#: how long, after a failure or a timeout, the other ranks get to unwind before being abandoned
GRACE_SECONDS = 0.25
#: how long ``close`` waits for the (idle) rank threads to leave
CLOSE_SECONDS = 2.0


class _RankThread:
    """A persistent daemon thread running one rank's tasks; replaced if it ever hangs."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.cpu: int | None = None   # the CPU this thread is kept on, None: wherever the OS puts it
        self.intra_op: int | None = None   # torch's intra-op thread count this thread took last
        self.thread = threading.Thread(target=self._loop, args=(device,), name=f"shardverify-rank{rank}",
                                       daemon=True)
        self.thread.start()

    def keep_on(self, cpu: int | None) -> None:
        """Run this thread on ``cpu`` from now on (a no-op where that cannot be done)."""
        if cpu is None or cpu == self.cpu or self.thread.native_id is None:
            return
        if keep_to_cpu(cpu, self.thread.native_id):
            self.cpu = cpu

    def take_intra_op(self, count: int) -> threading.Event:
        """Have this thread's ops use ``count`` intra-op threads from now on; set once it has."""
        taken = threading.Event()

        def take() -> None:
            torch.get_num_threads()   # torch's first look in a thread sets it to the default: now, not later
            torch.set_num_threads(count)   # this thread's OpenMP and MKL settings (and torch's default)
            self.intra_op = count
            taken.set()

        self.tasks.put(take)
        return taken

    def _loop(self, device: torch.device) -> None:
        torch.autograd.set_multithreading_enabled(False)   # thread-local: backward runs here
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)   # the current device is per thread
        while (task := self.tasks.get()) is not None:
            task()


class _Batch:
    """Outcomes of one batch of checks, filled in by the rank threads.

    The caller is woken only when it must act: a check failed, the check it unwinds after a
    failure or a timeout (``grace``) is complete, or the whole batch is.  Each check's
    completion time is kept, so the caller, waking late, still gives every check its timeout
    from the moment the one before it finished (woken per check, it cost every check a thread
    switch while the ranks ran)."""

    def __init__(self, world: int, size: int) -> None:
        self.cond = threading.Condition()
        self.results: list[dict[int, RankResult | None]] = [{} for _ in range(size)]   # None: aborted
        self.failed: list[bool] = [False] * size
        self.finished_at: list[float | None] = [None] * size   # time.monotonic() when every rank was done
        self.grace: int | None = None   # the check the caller waits to see unwound
        self.cancelled = False   # the caller gave up on this batch: ranks stop at the next check
        self.world = world

    def finish(self, index: int, rank: int, result: RankResult | None) -> None:
        with self.cond:
            self.results[index][rank] = result
            failed = result is not None and not result.ok
            self.failed[index] = self.failed[index] or failed
            complete = len(self.results[index]) == self.world
            if complete:
                self.finished_at[index] = time.monotonic()
            if failed or (complete and (index == len(self.results) - 1 or index == self.grace)):
                self.cond.notify_all()

    def wait(self, until: Callable[[], bool], deadline: float) -> bool:
        with self.cond:
            while not until():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True

    def started(self, index: int, began: float) -> float:
        """When check ``index`` could start: when the one before it finished (``began`` for the first)."""
        with self.cond:
            before = self.finished_at[index - 1] if index else None
        return began if before is None else before

    @property
    def aborted(self) -> bool:   # read by _Turns.wait like an exchange's flag
        return self.cancelled

    def done(self, index: int) -> bool:
        return len(self.results[index]) == self.world

    def pending(self, index: int) -> list[int]:
        return [r for r in range(self.world) if r not in self.results[index]]


class SimulatedBackend(BatchBackend):
    """Run SPMD checks on a simulated mesh: one thread per rank, all on ``device``.

    ``timeout`` (seconds) bounds every check; a rank that raises aborts the others'
    collectives of that check at once.  Each rank gets its own deep copy of ``args``, as it
    would across processes (frozen values, which cannot change, are shared).  The backend
    stays usable after any failure.  ``same_cpu`` keeps the rank threads on the caller's CPU,
    each with one intra-op thread (see the module docstring); turn it off for ops big enough
    to want torch's intra-op threads: the ranks then use the caller's count.  ``stacked``: a
    function that offers a form over all ranks at once (``fn.all_ranks(ranks, *args)``, taking a
    ``backends.stacked.AllRanks``: the strategy check does) runs in that form, every rank in one
    thread (see backends/stacked.py); off, it runs one thread per rank like any other function.
    """

    def __init__(self, mesh: DeviceMesh, device: torch.device | str = "cpu", timeout: float = 30.0,
                 *, same_cpu: bool = True, stacked: bool = True) -> None:
        if not isinstance(mesh, DeviceMesh):
            raise BackendError(f"SimulatedBackend needs a DeviceMesh, got {mesh!r}")
        self.mesh = mesh
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise BackendError(f"SimulatedBackend device must name a torch device, got {device!r}") from exc
        self.timeout = check_timeout(timeout, 30.0)
        if not isinstance(same_cpu, bool):
            raise BackendError(f"SimulatedBackend same_cpu must be True or False, got {same_cpu!r}")
        self.same_cpu = same_cpu
        if not isinstance(stacked, bool):
            raise BackendError(f"SimulatedBackend stacked must be True or False, got {stacked!r}")
        self.stacked = stacked
        self._lock = threading.Lock()
        self._threads: list[_RankThread | None] = [None] * mesh.size
        self._closed = False
        start = time.perf_counter()
        self._start_threads()
        self.startup_seconds = time.perf_counter() - start

    def _start_threads(self) -> None:
        for rank, worker in enumerate(self._threads):
            if worker is None:
                self._threads[rank] = _RankThread(rank, self.device)

    def run_batch(self, fn: Callable[..., Any], items: Sequence[tuple], *,
                  timeout: float | None = None) -> list[list[Any] | BackendError]:
        """``fn(comm, *args)`` on every rank for each ``args`` of ``items``, one check after
        the other, in one hand-over to the rank threads.  Per item: the values indexed by
        rank, or the BackendError that ``run`` would have raised for it; each item has the
        whole ``timeout`` from the moment the one before it finished."""
        check_fn(fn)
        timeout = check_timeout(timeout, self.timeout)
        items = [tuple(args) for args in items]
        if threading.current_thread().name.startswith("shardverify-rank"):
            raise BackendError("SimulatedBackend.run cannot be called from inside a rank")
        outcomes: list[list[Any] | BackendError] = []
        all_ranks = getattr(fn, "all_ranks", None) if self.stacked else None
        with self._lock, _kept_on_this_cpu(self.same_cpu) as cpu:
            while len(outcomes) < len(items):   # a timeout abandons the rest; they run again
                if self._closed:
                    raise BackendError("this SimulatedBackend is closed")
                rest = items[len(outcomes):]
                outcomes += (self._run_batch(fn, rest, timeout, cpu) if all_ranks is None else
                             self._run_all_ranks(all_ranks, fn, rest, timeout, cpu))
        return outcomes

    def _run_all_ranks(self, all_ranks, fn, items: list[tuple], timeout: float,
                       cpu: int | None) -> list[list[Any] | BackendError]:
        """Run ``items`` in ``fn``'s all-ranks form on rank 0's thread (kept on ``cpu`` unless
        None), until the first timeout (included in the outcomes, the rest is not).  The form
        runs once for all ranks and promises to leave its arguments as they are, so they are
        not copied.  The caller is woken when the batch is done or a check's time is up (woken
        per check, each cost a thread switch).  An error is the rank's it names (``exc.rank``:
        the op raised there), else the lowest rank's, as when every rank fails alike on the
        threaded mesh."""
        self._start_threads()
        worker = self._threads[0]
        worker.keep_on(cpu)
        self._match_intra_op(1 if cpu is not None else torch.get_num_threads())
        cond = threading.Condition()
        outcomes: list[list[Any] | BackendError] = []
        finished = [time.monotonic()]   # when the last check finished (the start for the first)
        cancelled = threading.Event()

        def task() -> None:
            for args in items:
                if cancelled.is_set():
                    return
                try:
                    outcome = all_ranks(AllRanks(self.mesh, self.device), *args)
                except BaseException as exc:  # noqa: BLE001 - reported to the caller as RankError
                    rank = getattr(exc, "rank", None)
                    outcome = RankResult.failure(rank if isinstance(rank, int) else 0, exc).error()
                with cond:
                    outcomes.append(outcome)
                    finished[0] = time.monotonic()
                    if len(outcomes) == len(items):
                        cond.notify_all()

        worker.tasks.put(task)
        try:
            with cond:
                while len(outcomes) < len(items):
                    left = finished[0] + timeout - time.monotonic()
                    if left <= 0:
                        cancelled.set()
                        worker.tasks.put(None)   # a new thread takes rank 0's place on the next run
                        self._threads[0] = None
                        return outcomes + [RankTimeout(tuple(range(self.mesh.size)), timeout, _name(fn),
                                                       detail="every rank runs in one thread (stacked); the "
                                                              "check did not finish")]
                    cond.wait(left)
                return list(outcomes)
        except BaseException:   # Ctrl-C while waiting: the thread stops at the next check
            cancelled.set()
            raise

    def _run_batch(self, fn, items: list[tuple], timeout: float,
                   cpu: int | None) -> list[list[Any] | BackendError]:
        """Run ``items`` (the rank threads kept on ``cpu`` unless None) until the first
        timeout (included in the outcomes, the rest is not)."""
        self._start_threads()
        for worker in self._threads:
            worker.keep_on(cpu)
        self._match_intra_op(1 if cpu is not None else torch.get_num_threads())
        turns = _Turns(self.mesh.size)
        exchanges = [_Exchange(turns) for _ in items]
        batch = _Batch(self.mesh.size, len(items))
        first = [private_copy(args) for args in items]   # frozen arguments come back as they are:
        for rank, worker in enumerate(self._threads):     # shared by every rank, walked once per batch
            copies = first if rank == 0 else [c if c is args else private_copy(args) for c, args in zip(first, items)]
            worker.tasks.put(self._task(fn, copies, rank, turns, exchanges, batch))
        outcomes: list[list[Any] | BackendError] = []
        began = time.monotonic()
        try:
            for index, exchange in enumerate(exchanges):
                finished = batch.wait(lambda: batch.done(index) or batch.failed[index],
                                      batch.started(index, began) + timeout)
                if not finished:
                    with turns.lock, batch.cond:   # who was inside a collective when time ran out
                        blocked, late = set(turns.waiting), batch.pending(index)
                        absent, where = exchange.never_entered()
                if not finished or batch.failed[index]:
                    with batch.cond:
                        batch.grace = index
                    exchange.abort()
                    batch.wait(lambda: batch.done(index), time.monotonic() + GRACE_SECONDS)
                with batch.cond:
                    stuck = batch.pending(index)
                    results = dict(batch.results[index])
                failures = [r for r in results.values() if r is not None and not r.ok]
                if failures:   # the lowest failing rank: deterministic when several fail alike
                    outcomes.append(min(failures, key=lambda f: f.rank).error())
                elif not finished:   # blame ranks busy outside collectives; a pure deadlock blames all
                    culprits = [r for r in late if r not in blocked] or late
                    outcomes.append(RankTimeout(tuple(culprits), timeout, _name(fn),
                                                never_entered=absent, detail=where))
                else:
                    outcomes.append([results[rank].value for rank in range(self.mesh.size)])
                if stuck:   # still running user code: abandon the batch and those threads
                    self._abandon(batch, exchanges, stuck)
                    break
        except BaseException:   # Ctrl-C while waiting: unblock the ranks, then propagate
            self._abandon(batch, exchanges, [])
            raise
        return outcomes

    def _match_intra_op(self, count: int) -> None:
        """Give every rank thread ``count`` intra-op threads: 1 when kept on one CPU, else the
        caller's.  A thread's own OpenMP team otherwise follows OpenMP's default (one per CPU),
        not ``torch.set_num_threads``: a rank kept on one CPU ran BLAS calls as a team of two
        threads on that one CPU (linear on (2,2): 3.7 -> 3.2 ms per check with one), and a
        free rank ignored the caller's setting.  Done once per thread and count; torch's
        default for threads started later is the caller's again afterwards."""
        stale = [worker for worker in self._threads if worker.intra_op != count]
        if not stale:
            return
        caller = torch.get_num_threads()
        taken = [worker.take_intra_op(count) for worker in stale]
        deadline = time.monotonic() + CLOSE_SECONDS
        for event in taken:   # idle threads answer at once; one still unwinding takes it before its next task
            event.wait(max(0.0, deadline - time.monotonic()))
        if count != caller:
            torch.set_num_threads(caller)

    def _abandon(self, batch: _Batch, exchanges: list[_Exchange], stuck: list[int]) -> None:
        with batch.cond:
            batch.cancelled = True
        for exchange in exchanges:
            exchange.abort()
        for rank in stuck:   # a new thread takes the rank's place on the next run
            self._threads[rank].tasks.put(None)
            self._threads[rank] = None

    def _task(self, fn, items, rank, turns, exchanges, batch) -> Callable[[], None]:
        def task() -> None:
            try:
                turns.take(rank)
            except _Aborted:   # pragma: no cover - take() never aborts
                return
            try:
                for index, (args, exchange) in enumerate(zip(items, exchanges)):
                    if batch.cancelled:
                        return
                    comm = SimulatedCommunicator(self.mesh, rank, self.device, exchange)
                    try:
                        value = fn(comm, *args)
                    except _Aborted:
                        batch.finish(index, rank, None)
                    except BaseException as exc:  # noqa: BLE001 - reported to the caller as RankError
                        batch.finish(index, rank, RankResult.failure(rank, exc))
                        exchange.abort()
                    else:
                        batch.finish(index, rank, RankResult(rank, True, value))
                    if index + 1 < len(items):   # no rank starts a check before all left the last
                        with turns.lock:
                            turns.wait(rank, lambda: batch.done(index), batch)
            except _Aborted:   # the batch was given up while this rank waited between checks
                return
            finally:
                turns.release(rank)

        return task

    def close(self) -> None:
        """Stop the rank threads and wait (briefly) until they have left: a thread still
        unwinding while the interpreter shuts down can abort the process.  (A thread stuck in
        user code was abandoned when its check timed out, and is left to die with the process.)"""
        with self._lock:
            self._closed = True
            stopping = [worker for worker in self._threads if worker is not None]
            self._threads = [None] * len(self._threads)
            for worker in stopping:
                worker.tasks.put(None)
            deadline = time.monotonic() + CLOSE_SECONDS
            for worker in stopping:
                worker.thread.join(max(0.0, deadline - time.monotonic()))

    def __repr__(self) -> str:
        return f"SimulatedBackend(mesh={self.mesh.shape}, device={str(self.device)!r})"


@contextlib.contextmanager
def _kept_on_this_cpu(enabled: bool) -> Iterator[int | None]:
    """The CPU the calling thread runs on, the thread kept there until the block ends (its
    CPU set restored then); None, and nothing changed, when not ``enabled`` or not Linux.

    The caller sleeps while the ranks run, but wakes when a check fails and when the batch
    ends: kept off the ranks' CPU, each wake-up crossed cores too (measured while it still
    woke as each check ended, a linear check on (2,2): 2.0 ms -> 1.8 ms)."""
    cpu = _current_cpu() if enabled else None
    if cpu is None:
        yield None
        return
    try:
        before = os.sched_getaffinity(0)   # 0: the calling thread
        os.sched_setaffinity(0, {cpu})
    except OSError:   # not ours to change: the ranks are still kept together
        yield cpu
        return
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)


def _current_cpu() -> int | None:
    """The CPU the calling thread runs on right now, None where the platform does not say."""
    getcpu = _sched_getcpu()
    if getcpu is None:
        return None
    cpu = getcpu()
    return cpu if cpu >= 0 else None


@functools.lru_cache(maxsize=1)
def _sched_getcpu() -> Callable[[], int] | None:
    """The C library's ``sched_getcpu``, None without it or without ``os.sched_setaffinity``."""
    if not can_keep():
        return None
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):   # not glibc/musl (not Linux)
        return None
    getcpu.restype, getcpu.argtypes = ctypes.c_int, []
    return getcpu


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
