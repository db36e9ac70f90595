"""`shardverify verify --jobs N`: the (case, mesh) rows shared among N worker processes.

A simulated check runs one rank at a time (the GIL), so one process keeps one core busy;
rows are independent, so N processes keep N cores busy.  Each worker keeps one simulated
backend per mesh shape for all its rows, on a CPU of its own while there are enough.  A
case's rows on its meshes go to one worker together: a process builds a case's trace,
reference and distinguishing seeds once, and makes the op's meta calls once for the local
shapes its meshes share (rows sent apart would each build them again in another worker).  At
most N cases are in flight.  A worker that dies (an op that crashes the interpreter) loses
only the rows it was running: each of them runs again by itself, and a row that kills its
worker even alone fails with that error while every other row is still verified.  Rows come
back in plan order, as the sequential run gives them.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import multiprocessing.util
import os
from collections.abc import Sequence
from typing import Any

from shardverify.cli.verify_rows import (WORKER_BACKENDS, WORKER_PRELOAD, Interrupted, Progress, Row, close_backends,
                                          describe_error, row_label, worker_rows)
from shardverify.backends.cpus import keep_to_cpu, thread_share, usable_cpus
from shardverify.backends.process_worker import clean_up_after, process_start, watch_parent
from shardverify.backends.signals import signals_held, start_forkserver
from shardverify.errors import ShardVerifyError


def verify_rows_in_workers(plan: Sequence[tuple], jobs: int, *, device: str | None, timeout: float,
                           progress: Progress, error_maps: bool = False) -> list[Row]:
    """``verify_row`` of every plan item on simulated backends in ``jobs`` processes (``error_maps``:
    failing checks keep where they are wrong, for a report: verify/error_map.py)."""
    rows: list[Row | None] = [None] * len(plan)
    queue = list(range(len(plan)))   # not run yet, in plan order
    alone: list[int] = []   # in flight when a worker died: each runs again by itself
    counter = multiprocessing.get_context("forkserver").Value("i", 0)   # numbers the workers (their CPUs)
    try:
        while queue or alone:
            if queue:
                alone += [index for index, _ in _run(plan, queue, min(jobs, len(queue)), rows, counter, jobs,
                                                     device, timeout, progress, error_maps)]
                continue
            index = alone.pop(0)
            lost = _run(plan, [index], 1, rows, counter, jobs, device, timeout, progress, error_maps)
            if lost:
                op, case_id, _, mesh = plan[index]
                rows[index] = Row(op, case_id, mesh,
                                  error=f"its worker process died, also when it ran alone: {lost[0][1]}", failures=1)
                progress.step()
    except KeyboardInterrupt:
        raise Interrupted([row for row in rows if row is not None], len(plan)) from None
    unset = [row_label(plan[i]) for i, row in enumerate(rows) if row is None]
    if unset:   # every row is run until it has a result: a gap is a bug here, never a silent omission
        raise ShardVerifyError(f"--jobs left rows without a result: {', '.join(unset)}")
    return rows  # type: ignore[return-value]


def start_workers_early() -> None:
    """Start the workers' forkserver before the specs are read: its imports (torch, the engine,
    torch._dynamo: several CPU-seconds, before any worker can start) then run on another CPU
    while this process reads the specs and builds the plan, instead of after them while every
    CPU but one waits. A run that ends before its rows (a spec error) leaves it to end when its
    imports are done and it finds this process gone, as any stop before the first worker does
    (backends/forkserver_exit.py)."""
    start_forkserver(multiprocessing.get_context("forkserver"), WORKER_PRELOAD)


def _run(plan: Sequence[tuple], queue: list[int], width: int, rows: list[Row | None], counter: Any, jobs: int,
         device: str | None, timeout: float, progress: Progress, error_maps: bool = False) -> list[tuple[int, str]]:
    """Run ``queue``'s rows (taken from its front, a case's rows together: :func:`_next_group`) with
    at most ``width`` cases in flight, until it is empty or a worker dies; the rows in flight then
    are returned as (index, error) pairs (their rows left unset), every other finished row is set
    in ``rows``."""
    ctx = multiprocessing.get_context("forkserver")
    start_forkserver(ctx, WORKER_PRELOAD)   # imported once in the forkserver, not by each worker   # deaf to the terminal's Ctrl-C: the workers are terminated below (backends/signals.py)
    cpus = usable_cpus()
    pool = cf.ProcessPoolExecutor(width, mp_context=ctx, initializer=_start_worker,
                                  initargs=(counter, cpus if jobs <= len(cpus) else [], thread_share(jobs),
                                            os.getpid(), (multiprocessing.util.get_temp_dir(),),
                                            process_start(os.getpid())))
    running: dict[cf.Future, list[int]] = {}
    lost: list[tuple[int, str]] = []
    singles: set[int] = set()   # rows of a group that raised: each is sent again on its own
    try:
        while (queue or running) and not lost:
            while queue and len(running) < width:
                group = _next_group(plan, queue, singles)
                with signals_held():   # a submit may start a worker: never cut in two (backends/signals.py)
                    running[pool.submit(worker_rows, [plan[i] for i in group], device, timeout, error_maps)] = group
            done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for future in done:
                group = running.pop(future)
                try:
                    found = future.result()
                except cf.process.BrokenProcessPool as exc:
                    lost += [(index, describe_error(exc)) for index in group]
                    continue
                except Exception as exc:  # noqa: BLE001 - e.g. a row that cannot travel back: fails alone
                    if len(group) > 1:
                        singles.update(group)
                        queue[:0] = group
                        continue
                    op, case_id, _, mesh = plan[group[0]]
                    found = [Row(op, case_id, mesh, error=describe_error(exc), failures=1)]
                for index, row in zip(group, found):
                    rows[index] = row
                    progress.step()
                progress.show(row_label(plan[group[-1]]))
        for future, group in running.items():   # the pool is broken: these were lost with it
            lost += [(index, "the worker pool broke while it ran") for index in group]
        return lost
    except BaseException:   # Ctrl-C: stop the workers now, not after their rows
        for process in list(getattr(pool, "_processes", {}).values()):
            process.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _next_group(plan: Sequence[tuple], queue: list[int], singles: set[int]) -> list[int]:
    """The rows at the front of ``queue`` (taken from it) that verify one case, on its meshes in
    plan order; a row in ``singles`` goes alone."""
    group = [queue.pop(0)]
    if group[0] in singles:
        return group
    op, case_id = plan[group[0]][:2]
    while queue and queue[0] not in singles and plan[queue[0]][:2] == (op, case_id):
        group.append(queue.pop(0))
    return group


def _start_worker(counter: Any, cpus: list[int], threads: int, parent_pid: int, leftovers: tuple[str, ...],
                  parent_started: int | None = None) -> None:
    """A worker's set-up: its own CPU (the n-th worker started, the n-th CPU) when there is one
    per worker, torch's share of the CPUs, the collector settings of a checking process, its
    backends closed at exit, and its exit (with multiprocessing's temp folder removed) when the
    `verify` process is killed (known by its pid and start time, as pool workers know theirs:
    a reused pid is not the parent)."""
    import threading

    import torch

    threading.Thread(target=watch_parent, args=(parent_pid, leftovers, parent_started), daemon=True).start()
    if leftovers:   # this worker's own temporary folders (an isolated check's forkserver: verify/isolated.py)
        import tempfile   # inside its `verify`'s multiprocessing folder, removed with it however the run ends

        tempfile.tempdir = leftovers[0]

    from shardverify.cli.verify_rows import quiet_tracing
    from shardverify.backends.gc_policy import tune_for_checking

    with counter.get_lock():
        number = counter.value
        counter.value += 1
    if cpus:
        keep_to_cpu(cpus[number % len(cpus)])
    torch.set_num_threads(threads)
    tune_for_checking()
    quiet_tracing()
    # multiprocessing ends its workers with os._exit: atexit would never run
    multiprocessing.util.Finalize(None, close_backends, args=(WORKER_BACKENDS,), exitpriority=10)
    # a worker ending (its call queue broken) while its watch removes the leftovers of a killed
    # `verify` would cut the removal short: it finishes it first (as a pool worker does)
    multiprocessing.util.Finalize(None, clean_up_after, args=(parent_pid, leftovers, 0.0, parent_started),
                                  exitpriority=0)


__all__ = ["verify_rows_in_workers", "start_workers_early"]
