"""A persistent pool of worker processes, one per mesh rank, joined by torch.distributed.

Starting processes and process groups costs seconds; a check must not.  The pool starts
once (forkserver or spawn context, rendezvous through a ``FileStore`` in a fresh temporary
directory, never a port), builds one process group per set of mesh axes, then streams tasks
``(fn, args)`` to every rank and collects the per-rank results.

Any failure (a rank raised while others are stuck, a rank died, a timeout) tears the pool
down; the next ``run`` starts a new one.  A rank that raises while the others finish keeps
the pool.  ``close()``, the context manager, dropping the backend and interpreter exit
leave no process behind; workers also exit on their own when this process disappears.
"""

from __future__ import annotations

import atexit
import math
import multiprocessing
import multiprocessing.util
import multiprocessing.connection
import os
import pickle
import select
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from shardverify.backends.base import BatchBackend, RankResult, check_fn, check_timeout
from shardverify.errors import BackendError, RankDied, RankError, RankTimeout
from shardverify.backends.signals import signals_held, start_forkserver
from shardverify.backends.liveness import process_alive, process_start
from shardverify.backends.process_worker import SharedState, WorkerConfig, worker_cpus, worker_main
from shardverify.sharding.mesh import DeviceMesh

DIST_BACKENDS = ("gloo", "nccl")
#: "forkserver" (default) imports torch once in a server process and forks workers from it,
#: so a pool (re)start costs well under a second after the first; "spawn" re-imports per worker
START_METHODS = ("forkserver", "spawn")
#: what the forkserver imports once, so no worker imports it again: torch, the verifier's own
#: modules with the symbolic-shapes machinery its tracing pulls in (sympy), and torch._dynamo,
#: which torch imports on the first call of any dynamo-disabled function (nn.Linear's forward
#: among them): about a second of CPU per worker, paid by every worker of every pool otherwise
FORKSERVER_PRELOAD = (__name__, "shardverify.backends.process_worker", "torch.distributed", "shardverify.verify.engine", "shardverify.strategies.for_node",
                      "torch.fx.experimental.symbolic_shapes", "torch._dynamo")
#: how long the other ranks may take to finish after one raised, before the pool is rebuilt
GRACE_SECONDS = 1.0
#: start-up (process start, import torch, rendezvous, groups) is bounded separately from a run
STARTUP_TIMEOUT = 120.0


_LONGEST_POLL = 3600.0   # seconds
#: how long a worker whose pipe has closed may take to report its exit code: the forkserver
#: reaps it and passes the code on, which took over a second once on a loaded CI machine
_REAP_SECONDS = 10.0


def _kill_workers_left() -> None:
    """SIGKILL every pool worker still running at interpreter exit.  Workers ignore SIGTERM (the
    parent stops them), and multiprocessing's own exit handler SIGTERMs its daemonic children and
    then joins them without a timeout: a stop that lands as a pool starts, before the pool is known
    to its backend, left the exit waiting until the workers gave up on their rendezvous (over
    120 s under load).  Registered after multiprocessing's handler, so it runs before it."""
    for proc in multiprocessing.active_children():
        if proc.name.startswith("shardverify-rank"):
            proc.kill()


atexit.register(_kill_workers_left)


class _Pool:
    """One generation of worker processes and their pipes."""

    def __init__(self, mesh: DeviceMesh, dist_backend: str, devices: Sequence[str], check_metadata: bool,
                 collective_timeout: float, start_method: str, keep_cpus: bool) -> None:
        ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":   # import once in the server, not in every worker
            start_forkserver(ctx, FORKSERVER_PRELOAD)   # deaf to the terminal's Ctrl-C (backends/signals.py)
        # inside multiprocessing's folder, which the forkserver removes if this process is killed
        # before any worker runs (backends/forkserver_exit.py)
        self.tmpdir = tempfile.mkdtemp(prefix="shardverify-pool-", dir=multiprocessing.util.get_temp_dir())
        self.shared = SharedState(ctx, mesh.size)
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self._poller: Any = None   # select.poll of the watched ranks' pipes and sentinels
        self._watched: dict[int, int] = {}   # fd in the poller (a rank's pipe or sentinel) -> rank
        self._pipes: dict[int, Any] = {}   # rank -> select.poll of its pipe alone
        try:
            cpus = worker_cpus(mesh.size) if keep_cpus else [None] * mesh.size
            for rank, cpu in zip(mesh.ranks, cpus):
                config = WorkerConfig(rank, mesh, os.path.join(self.tmpdir, "store"), dist_backend,
                                      devices[rank], check_metadata, os.getpid(), collective_timeout, cpu,
                                      (self.tmpdir, multiprocessing.util.get_temp_dir()), process_start(os.getpid()))
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=worker_main, args=(config, child_end, self.shared),
                                   name=f"shardverify-rank{rank}", daemon=True)
                with signals_held():   # started and known, or not started: kill() reaches every worker
                    proc.start()
                    self.procs.append(proc)
                child_end.close()
                self.conns.append(parent_end)
        except BaseException:
            self.kill()
            raise

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def ready(self, ranks: Iterable[int], timeout: float) -> list[int]:
        """Those of ``ranks`` that have sent something or whose process has ended, after waiting
        up to ``timeout`` seconds for one.  One poll object serves the pool, re-aimed only when
        the ranks waited for change: ``multiprocessing.connection.wait`` builds and fills a
        selector per call, which cost the parent more CPU than the rest of its work per check."""
        wanted = set(ranks)
        if not hasattr(select, "poll"):   # no poll(2) here: the portable wait
            owner = {self.conns[r]: r for r in wanted} | {self.procs[r].sentinel: r for r in wanted}
            return sorted({owner[obj] for obj in multiprocessing.connection.wait(list(owner), timeout)})
        if self._poller is None:
            self._poller = select.poll()
        watched = set(self._watched.values())
        for fd, rank in list(self._watched.items()):
            if rank not in wanted:   # unwatched, not masked: a hang-up is always reported
                self._poller.unregister(fd)
                del self._watched[fd]
        for rank in wanted - watched:
            for fd in (self.conns[rank].fileno(), self.procs[rank].sentinel):
                self._poller.register(fd, select.POLLIN)
                self._watched[fd] = rank
        # poll(2) takes an int of milliseconds: a longer wait ends early, and the caller waits again
        events = self._poller.poll(math.ceil(min(max(0.0, timeout), _LONGEST_POLL) * 1000))
        return sorted({self._watched[fd] for fd, _ in events})

    def has_message(self, rank: int) -> bool:
        """Whether rank's pipe can be read without waiting (a message, or the end of the pipe
        when the worker is gone): ``Connection.poll`` with a poll object kept per pipe."""
        if not hasattr(select, "poll"):
            return self.conns[rank].poll()
        poller = self._pipes.get(rank)
        if poller is None:
            poller = self._pipes[rank] = select.poll()
            poller.register(self.conns[rank].fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def dead(self) -> list[int]:
        """Ranks whose process has exited.  A forkserver child's exit status reaches us
        through the forkserver, which reaps the child first and writes the status after:
        a process already reaped (no such pid) counts as dead before its status arrives."""
        return [rank for rank, proc in enumerate(self.procs) if not proc.is_alive() or not process_alive(proc.pid)]

    def stop(self, wait: float = 2.0) -> None:
        """Ask the workers to leave, then kill whoever did not."""
        stop = pickle.dumps((None, None, None, None))
        for conn in self.conns:
            try:
                conn.send_bytes(stop)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        self._poller, self._watched, self._pipes = None, {}, {}
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5.0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        shutil.rmtree(self.tmpdir, ignore_errors=True)


class ProcessBackend(BatchBackend):
    """Run SPMD checks on real torch.distributed ranks kept alive between runs.

    ``backend``: "gloo" (CPU by default) or "nccl" (rank r on ``cuda:device_ids[r]``;
    ``device_ids`` defaults to ``mesh.device_ids``, pass a subset to partition GPUs between
    pytest-xdist workers).  ``device`` overrides the gloo device ("cpu").  ``timeout`` bounds
    every run; ``check_metadata`` compares call metadata before each collective (turn it
    off only to benchmark raw collectives).  ``keep_cpus`` keeps each worker on one CPU when
    the workers outnumber this process's CPUs (see ``worker_cpus``); pass False when other
    busy processes share those CPUs (pytest-xdist's workers: there the OS must be free to
    balance, and the suite ran 5% slower with every pool kept in place).  The pool starts on
    the first ``run`` or on ``start()``; ``startup_seconds`` is the time the last start took,
    ``starts`` counts them.
    """

    def __init__(self, mesh: DeviceMesh, backend: str = "gloo", device: str | None = None, timeout: float = 30.0,
                 *, device_ids: Sequence[int] | None = None, check_metadata: bool = True,
                 grace: float = GRACE_SECONDS, start_method: str = "forkserver", keep_cpus: bool = True) -> None:
        if not isinstance(mesh, DeviceMesh):
            raise BackendError(f"ProcessBackend needs a DeviceMesh, got {mesh!r}")
        if backend not in DIST_BACKENDS:
            raise BackendError(f"ProcessBackend backend must be one of {DIST_BACKENDS}, got {backend!r}")
        self.mesh = mesh
        self.backend = backend
        self.timeout = check_timeout(timeout, 30.0)
        self.grace = check_timeout(grace, GRACE_SECONDS)
        self.check_metadata = bool(check_metadata)
        if start_method not in START_METHODS:
            raise BackendError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        self.start_method = start_method
        if not isinstance(keep_cpus, bool):
            raise BackendError(f"ProcessBackend keep_cpus must be True or False, got {keep_cpus!r}")
        self.keep_cpus = keep_cpus
        self.devices = _rank_devices(mesh, backend, device, device_ids)
        self.startup_seconds: float | None = None
        self.starts = 0
        self._pool: _Pool | None = None
        self._task_id = 0
        self._sequence = 0   # checks sent to the current pool (the workers count their progress in it)
        self.notices: list[str] = []
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer: weakref.finalize | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the pool now (otherwise the first ``run`` does); a no-op when running."""
        with self._lock:
            self._ensure_pool()

    def _ensure_pool(self) -> _Pool:
        if self._closed:
            raise BackendError("this ProcessBackend is closed")
        if self._pool is not None:
            return self._pool
        began = time.perf_counter()
        self._sequence = 0
        self._pool = _Pool(self.mesh, self.backend, self.devices, self.check_metadata,
                           collective_timeout=max(self.timeout, 60.0), start_method=self.start_method,
                           keep_cpus=self.keep_cpus)
        # kill the workers if this backend is dropped unclosed, or at interpreter exit
        self._finalizer = weakref.finalize(self, self._pool.kill)
        limit = max(STARTUP_TIMEOUT, self.timeout)
        outcome = self._collect("setup", 1, "start-up", limit)[0]
        if isinstance(outcome, BaseException):
            raise outcome
        self.startup_seconds = time.perf_counter() - began
        self.starts += 1
        return self._pool

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (empty when no pool is running)."""
        return self._pool.pids() if self._pool is not None else []

    def close(self) -> None:
        """Stop every worker process; idempotent."""
        with self._lock:
            self._closed = True
            self._teardown(graceful=True)

    def _teardown(self, graceful: bool = False) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            self._finalizer.detach()
            pool.stop() if graceful else pool.kill()

    def __repr__(self) -> str:
        return f"ProcessBackend(mesh={self.mesh.shape}, backend={self.backend!r}, devices={self.devices})"

    # ---- running --------------------------------------------------------------------------
    def run_batch(self, fn: Callable[..., Any], items: Sequence[tuple], *,
                  timeout: float | None = None) -> list[list[Any] | BackendError]:
        """``fn(comm, *args)`` on every rank for each ``args`` of ``items``, sent to the workers
        as one message.  Per item: the values indexed by rank, or the BackendError ``run``
        would have raised for it; each item has the whole ``timeout`` from the moment the one
        before it finished.  When a failure costs the pool, the items after it run on the
        rebuilt pool.  ``fn`` and each ``args`` are pickled once (``fn`` by reference: a
        module-level function)."""
        check_fn(fn)
        timeout = check_timeout(timeout, self.timeout)
        items = [tuple(args) for args in items]
        outcomes: list[list[Any] | BackendError] = []
        with self._lock:
            while len(outcomes) < len(items):
                rest = items[len(outcomes):]
                try:
                    blob = pickle.dumps((fn, rest))
                except Exception as exc:  # noqa: BLE001
                    raise BackendError(f"cannot send {_name(fn)} and its args to the workers: {exc} "
                                       f"(fn must be a module-level function, args picklable)") from exc
                pool = self._ensure_pool()
                if pool.dead():   # killed between checks: not the next check's fault
                    self._note(f"worker(s) of rank(s) {pool.dead()} were found dead before "
                               f"{_name(fn)} started (exit codes "
                               f"{[pool.procs[r].exitcode for r in pool.dead()]}); the pool was rebuilt")
                    self._teardown()
                    pool = self._ensure_pool()
                self._task_id += 1
                first = self._sequence
                self._sequence += len(rest)
                message = pickle.dumps((self._task_id, first, len(rest), blob))
                try:
                    for conn in pool.conns:
                        conn.send_bytes(message)
                except OSError:
                    pass   # a dead worker: _collect reports it
                outcomes += self._collect(self._task_id, len(rest), _name(fn), timeout)
        return outcomes

    def _note(self, text: str) -> None:
        self.notices.append(text)
        warnings.warn(text, RuntimeWarning, stacklevel=3)

    def take_notices(self) -> list[str]:
        """What happened to the pool outside any check since the last call (and is no check's
        fault), e.g. a worker found dead and replaced; the verifier adds it to the next result."""
        found, self.notices = self.notices, []
        return found

    def _collect(self, key: object, count: int, what: str, timeout: float) -> list[list[Any] | BackendError]:
        """Every rank's answer to each of the ``count`` items of task ``key``, item after item.
        An item's outcome is its values, or on failure a death if any, else the lowest rank's
        error.  The pool is torn down (and the outcomes end there) unless every rank answered."""
        pool = self._pool
        assert pool is not None
        replies: list[dict[int, RankResult]] = [{} for _ in range(count)]
        outcomes: list[list[Any] | BackendError] = []
        try:
            for index in range(count):
                outcome, keep = self._collect_one(pool, key, index, replies, what, timeout)
                outcomes.append(outcome)
                if not keep:
                    self._teardown()
                    break
        except BaseException:   # Ctrl-C or an internal error: the pool's state is unknown
            self._teardown()
            raise
        return outcomes

    def _collect_one(self, pool: _Pool, key: object, index: int, replies: list[dict[int, RankResult]],
                     what: str, timeout: float) -> tuple[list[Any] | BackendError, bool]:
        """Wait for item ``index``; returns its outcome and whether the pool is still sound."""
        deadline = time.monotonic() + timeout
        pending = set(self.mesh.ranks) - set(replies[index])
        failure: BackendError | None = None
        for rank in sorted(set(self.mesh.ranks) - pending):
            failure = _worse(failure, replies[index][rank])
        grace_end: float | None = None if failure is None else time.monotonic() + self.grace
        broken = False   # a rank died: the others cannot finish
        while pending and not broken:
            left = (deadline if grace_end is None else min(deadline, grace_end)) - time.monotonic()
            if left <= 0:
                break
            for rank in pool.ready(pending, left):
                conn = pool.conns[rank]
                try:
                    while pool.has_message(rank):   # read everything this rank has sent so far
                        (got_key, got_index), result = pickle.loads(conn.recv_bytes())
                        if got_key == key and got_index < len(replies):
                            replies[got_index][rank] = result
                    if rank not in replies[index] and not pool.procs[rank].is_alive():
                        raise EOFError
                except (EOFError, OSError):   # the process is gone (its last answers were read)
                    pool.procs[rank].join(_REAP_SECONDS)   # returns once the exit code is known
                    if rank in replies[index]:
                        pending.discard(rank)
                        failure = _worse(failure, replies[index][rank])
                    if not isinstance(failure, RankDied):   # a death explains its peers' errors
                        failure = RankDied(rank, pool.procs[rank].exitcode, what)
                    broken = True
                    continue
                if rank in replies[index]:
                    pending.discard(rank)
                    failure = _worse(failure, replies[index][rank])
                    if failure is not None and grace_end is None:
                        grace_end = time.monotonic() + self.grace
        if failure is not None:
            return failure, not (pending or broken or key == "setup")
        if pending:   # blame ranks busy outside collectives; a pure deadlock blames all
            late = sorted(pending)
            culprits = [r for r in late if not pool.shared.busy[r]] or late
            absent, where = _never_entered(self.mesh, pool.shared, late)
            return RankTimeout(tuple(culprits), timeout, what, never_entered=absent, detail=where), False
        return [replies[index][r].value for r in self.mesh.ranks], True


def _worse(failure: BackendError | None, result: RankResult) -> BackendError | None:
    """The failure to report: a death wins, else the lowest failing rank (deterministic)."""
    if result.ok or isinstance(failure, RankDied):
        return failure
    if failure is None or (isinstance(failure, RankError) and result.rank < failure.rank):
        return result.error()
    return failure


def _never_entered(mesh: DeviceMesh, shared: SharedState, late: list[int]) -> tuple[tuple[int, ...], str]:
    """For a timeout: the members of each collective the late ranks wait in that never entered
    it (from the member bitmask and call number each rank publishes on entering)."""
    inside: dict[tuple[int, int], list[int]] = {}
    for rank in late:
        mask, call = shared.where[2 * rank], shared.where[2 * rank + 1]
        if shared.busy[rank] and mask:
            inside.setdefault((mask, call), []).append(rank)
    absent, lines = set(), []
    for (mask, call), ranks in sorted(inside.items()):
        members = [r for r in mesh.ranks if mask >> r & 1]
        missing = [r for r in members if r not in ranks]
        if missing:
            absent.update(missing)
            lines.append(f"rank(s) {ranks} wait in collective call {call} on group {members}; "
                         f"rank(s) {missing} never entered it")
    return tuple(sorted(absent)), "; ".join(lines)


def _rank_devices(mesh: DeviceMesh, backend: str, device: str | None, device_ids: Sequence[int] | None) -> list[str]:
    if backend == "gloo":
        if device_ids is not None:
            raise BackendError("device_ids only apply to backend='nccl'")
        try:
            torch.device(device or "cpu")
        except (RuntimeError, TypeError) as exc:
            raise BackendError(f"device must name a torch device, got {device!r}") from exc
        return [str(device or "cpu")] * mesh.size
    if device is not None:
        raise BackendError(f"backend='nccl' puts rank r on cuda:device_ids[r]; pass device_ids, not device={device!r}")
    ids = list(mesh.device_ids if device_ids is None else device_ids)
    if len(ids) != mesh.size:
        raise BackendError(f"device_ids {ids} must have one GPU id per rank ({mesh.size})")
    if len(set(ids)) != len(ids):
        raise BackendError(f"device_ids {ids} repeat a GPU; NCCL needs one GPU per rank")
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if any(not 0 <= i < available for i in ids):
        raise BackendError(f"backend='nccl' needs GPUs {ids}, but this machine has {available}")
    return [f"cuda:{i}" for i in ids]


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)

