"""The worker side of the process pool: one process per mesh rank, started by
:mod:`shardverify.backends.process`. A worker joins the torch.distributed world through the
pool's file store, builds a process group per set of mesh axes, keeps gloo's I/O threads out of
the ranks' way, then runs the ``(fn, args)`` tasks it is sent until told to stop or until the
pool's process disappears."""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from shardverify.backends.agreement import SharedAgreement
from shardverify.backends.base import RankResult
from shardverify.backends.cpus import can_keep, keep_to_cpu, usable_cpus
from shardverify.backends.gc_policy import tune_for_checking
from shardverify.backends.liveness import process_alive, process_start
from shardverify.sharding.mesh import DeviceMesh

__all__ = ["WorkerConfig", "SharedState", "worker_main", "worker_cpus", "thread_names", "batch_io_threads",
           "GLOO_IO_THREAD", "open_store", "end_within", "LAST_SECONDS", "clean_up_after", "process_start"]

#: gloo's TCP I/O threads (one per process group), which a worker runs under SCHED_BATCH
GLOO_IO_THREAD = "gloo_tcp_loop"


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs to join the world (picklable, sent at process start)."""

    rank: int
    mesh: DeviceMesh
    store_path: str
    dist_backend: str
    device: str
    check_metadata: bool
    parent_pid: int
    collective_timeout: float
    cpu: int | None = None   # the CPU the worker keeps to (see worker_cpus), None: where the OS puts it
    leftovers: tuple[str, ...] = ()   # folders the worker removes if the backend's process dies (SIGKILL)
    parent_started: int | None = None   # the parent's start time (process_start), to tell it from a reused pid


#: seconds a worker that found its parent gone may take to end before the kernel ends it
LAST_SECONDS = 30.0


def end_within(seconds: float) -> None:
    """Have the kernel end this process in ``seconds`` unless it ends first (SIGALRM, whose
    default action ends a process; left alone where SIGALRM has a handler).  A worker's
    clean-up and exit are Python, and run only while its main thread lets go of the GIL: one
    that takes it and never lets go (torch's FileStore constructor on a removed folder did,
    for 300 s, see ``open_store``) would keep the worker alive for good.  Any thread may arm it."""
    if hasattr(signal, "setitimer") and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None):
        signal.setitimer(signal.ITIMER_REAL, seconds)


def clean_up_after(parent_pid: int, leftovers: Iterable[str], wait: float = 2.0,
                    parent_started: int | None = None) -> None:
    """Remove ``leftovers`` if the process ``parent_pid`` is gone within ``wait`` seconds,
    and then leave this process ``LAST_SECONDS`` to end (``end_within``)."""
    deadline = time.monotonic() + wait
    while process_alive(parent_pid, parent_started):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    end_within(LAST_SECONDS)   # first: the removal below lets go of the GIL
    for folder in leftovers:
        shutil.rmtree(folder, ignore_errors=True)


def watch_parent(parent_pid: int, leftovers: Iterable[str] = (), parent_started: int | None = None) -> None:
    """Exit when the process that started this worker is gone, even if stuck in a collective,
    removing the folders it can no longer remove itself (its pool's store, multiprocessing's
    ``pymp-*``): a SIGKILL of that process leaves no process and no temp folder behind."""
    while True:
        if not process_alive(parent_pid, parent_started):
            clean_up_after(parent_pid, leftovers, 0.0, parent_started)
            os._exit(1)
        time.sleep(0.5)


#: descriptors of the pool store files this worker holds open (see open_store), for its lifetime
_HELD_STORES: list[int] = []


def open_store(path: str, world: int) -> Any:
    """The pool's ``FileStore``, opened so that removing the pool's folder cannot hang this worker.

    torch's FileStore reopens its file on every operation and, while the file's folder is
    missing, retries for its timeout (300 s), its constructor holding the GIL all along: no
    other thread of the worker runs, the parent watch included.  The folder goes when the
    pool's process dies: a worker's clean-up removes it (its own watch thread's, even, whose
    file I/O lets the main thread reach the constructor).  That was the 3 workers a SIGKILLed
    gloo run left in CI: reproduced, 3 of a 4-rank pool sat in the constructor's retry loop.
    So the worker opens the file first (FileNotFoundError: the pool is gone) and names it to
    the store by its descriptor where Linux's /proc allows (``/proc/self/fd/N``), which
    reaches the file however its folder is removed later.
    """
    import torch.distributed as dist

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    alias = f"/proc/self/fd/{fd}"
    if not os.path.exists(alias):   # no /proc: the folder's name it is
        os.close(fd)
        return dist.FileStore(path, world)
    _HELD_STORES.append(fd)
    return dist.FileStore(alias, world)


def worker_cpus(world: int, cpus: Iterable[int] | None = None) -> list[int | None]:
    """The CPU each of ``world`` workers keeps to: when they outnumber ``cpus`` (default: the
    CPUs this thread may run on; Linux), rank r on the ``r * n // world``-th of those n, so
    each CPU holds a block of neighbouring ranks; otherwise None for every rank (the OS
    places them).

    With more workers than cores the scheduler kept moving woken workers between cores at
    every collective.  Kept in place, a linear check on a warm (2,2) gloo pool on 2 cores
    took 2.5 ms instead of 3.4, and on (2,2,2) 5.4 ms instead of 6.5 (sum, with fewer
    collectives, was unchanged).  Nothing was measured with a core per worker, so there the
    OS keeps its say."""
    if cpus is None:
        if not can_keep():
            return [None] * world
        cpus = usable_cpus()
    ordered = sorted(cpus)
    if world <= len(ordered):
        return [None] * world
    return [ordered[rank * len(ordered) // world] for rank in range(world)]


def thread_names() -> dict[int, str]:
    """Thread id -> name of this process's threads (Linux's /proc; empty elsewhere)."""
    found = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as comm:
                found[int(tid)] = comm.read().strip()
        except OSError:   # the thread has gone
            continue
    return found


def batch_io_threads(name: str = GLOO_IO_THREAD) -> None:
    """Put this process's threads called ``name`` under SCHED_BATCH (Linux; elsewhere a no-op).

    While a collective is pending, gloo's I/O thread keeps polling its sockets: over 4
    processes one 64-float all-reduce costs each of them 1.4 ms of that thread's CPU (0.2 ms
    over 2).  When the processes outnumber the cores, every wake-up of a polling thread
    preempts a rank that has real work, so the all-reduce took 5 ms on 2 cores.  A batch
    thread still gets its fair share of CPU but never preempts on waking: the same
    all-reduce, and a linear check on a (2,2) pool, then take about half as long, and under
    full load from other processes they are no slower (SCHED_IDLE, tried too, starves the
    thread under load: 15x slower).  The ranks' own threads keep the normal policy.
    """
    if not hasattr(os, "SCHED_BATCH"):
        return
    for tid, thread in thread_names().items():
        if thread != name:
            continue
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except OSError:   # the thread is gone, or the policy is not ours to set: only speed is lost
            continue


def worker_main(config: WorkerConfig, conn: multiprocessing.connection.Connection, shared: Any) -> None:
    """Entry point of a pool worker: ``_serve`` until told to stop; however that ends, with the
    pool's process gone, the leftovers are removed here too: the watch thread may be half-way
    through removing them, and the process's end would cut it short (one way a SIGKILLed gloo
    run left its ``pymp-*`` folder under load: a worker started after the kill found its store's
    folder gone and returned while its watch was still removing the ``pymp-*`` one)."""
    try:
        _serve(config, conn, shared)
    finally:
        clean_up_after(config.parent_pid, config.leftovers, 0.0, config.parent_started)


def _serve(config: WorkerConfig, conn: multiprocessing.connection.Connection, shared: Any) -> None:
    """Join the world, then run tasks until told to stop.

    A task is a batch of checks ``(fn, [args, ...])``; each check's result is sent as soon as
    it is known.  A rank whose check raised goes on to the next check only once every rank
    has left that check (``shared.progress``): a rank still blocked in one of its collectives
    must never meet a collective of the next check instead.
    """
    import torch.distributed as dist

    from shardverify.backends.distributed import ProcessCommunicator, build_groups

    keep_to_cpu(config.cpu)   # first: the threads started below (gloo's among them) inherit it
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's to handle
    # so is a SIGTERM to the whole group (`kill -- -PGID`, a CI timeout): the parent stops its pool
    # (with SIGKILL where it must), or, gone, its workers remove what it left (watch_parent), its
    # multiprocessing ``pymp-*`` folder among them. Ended by the group's SIGTERM themselves, they
    # left that folder whenever the parent then ended without its exit handlers (twice in CI:
    # an xdist worker's, with no process left)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=watch_parent, args=(config.parent_pid, config.leftovers, config.parent_started),
                     daemon=True).start()
    torch.set_num_threads(1)
    rank, mesh = config.rank, config.mesh
    try:
        device = torch.device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = open_store(config.store_path, mesh.size)
        dist.init_process_group(config.dist_backend, store=store, rank=rank, world_size=mesh.size,
                                timeout=datetime.timedelta(seconds=config.collective_timeout))
        groups = build_groups(mesh, rank)
        batch_io_threads()   # every group's I/O thread exists now
        tune_for_checking()   # fewer full collections (see gc_policy)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        _reply(conn, ("setup", 0), RankResult.failure(rank, exc))
        return
    _reply(conn, ("setup", 0), RankResult(rank, True))
    while True:
        try:
            task_id, first, count, blob = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):   # the pipe closed without a stop: the backend's process may be dead
            clean_up_after(config.parent_pid, config.leftovers, parent_started=config.parent_started)
            break
        if task_id is None:
            break
        try:
            fn, items = pickle.loads(blob)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, for every check of the task
            for index in range(count):
                _reply(conn, (task_id, index), RankResult.failure(rank, exc))
            shared.progress[rank] = first + count
            continue
        for index, args in enumerate(items):
            try:
                comm = ProcessCommunicator(mesh, rank, device, groups, check_metadata=config.check_metadata,
                                           native_reduce_scatter=config.dist_backend == "nccl",
                                           busy=shared.busy, where=shared.where, agreement=shared.agreement,
                                           check=first + index)
                result = RankResult(rank, True, fn(comm, *args))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                result = RankResult.failure(rank, exc)
            finally:
                shared.busy[rank] = 0
            _reply(conn, (task_id, index), result)
            shared.progress[rank] = first + index + 1
            if not result.ok and index + 1 < len(items):
                while min(shared.progress) < first + index + 1:
                    time.sleep(0.001)
    dist.destroy_process_group()


def _reply(conn: multiprocessing.connection.Connection, key: object, result: RankResult) -> None:
    """Send ``result`` to the pool's process; nothing if it is gone (a closed pipe: the next
    read ends the worker, or its parent watch does, with no traceback printed after a SIGKILL)."""
    try:
        data = pickle.dumps((key, result))
    except Exception as exc:  # noqa: BLE001 - an unpicklable return value
        data = pickle.dumps((key, RankResult.failure(
            result.rank, TypeError(f"the value returned by rank {result.rank} cannot be pickled: {exc}"))))
    try:
        conn.send_bytes(data)
    except (BrokenPipeError, ConnectionResetError):
        pass


class SharedState:
    """Shared memory between the pool's parent and workers: who sits inside a collective
    (``busy``), which one (``where``: member bitmask and call number per rank, for blame),
    how many checks each rank has finished (``progress``), and the workers' call agreement
    (``agreement``: no extra collective per checked call)."""

    def __init__(self, ctx: Any, world: int) -> None:
        self.busy = ctx.RawArray("b", world)
        self.where = ctx.RawArray("q", 2 * world)
        self.progress = ctx.RawArray("q", world)
        self.agreement = SharedAgreement(ctx, world)
