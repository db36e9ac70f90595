"""SIGTERM as an exception, so that a checking process stopped by ``kill`` or a CI timeout
cleans up like one stopped by Ctrl-C; and a time limit raised as an exception (SIGALRM).

The default action of SIGTERM ends the process at once: its ``finally`` blocks and exit handlers
never run, and the worker pools, forkservers, resource trackers, shared-memory semaphores and
temp folders they would have stopped or removed are left behind. Raised as ``SystemExit(143)``
in the main thread, they run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from shardverify import stops
from shardverify.backends import forkserver_exit
from shardverify.backends.liveness import process_start

__all__ = ["Terminated", "exit_on_sigterm", "interrupt_on_sigterm", "start_forkserver", "signals_held", "keep_interrupts", "deadline"]


def exit_on_sigterm():
    """Make SIGTERM raise ``SystemExit(128 + SIGTERM)`` in the main thread. Returns the previous
    handler (to restore), or None off the main thread, where no handler can be set."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminate(signum, frame):  # noqa: ANN001
        stops.record(lambda: SystemExit(128 + signum))   # raised again where the run's loops ask (stops.py)
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, terminate)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt where a framework stops cleanly only on one (pytest:
    ``SystemExit`` in its main loop is an INTERNALERROR with a traceback, a KeyboardInterrupt
    ends the session, running its teardown)."""

    def __init__(self) -> None:
        super().__init__("stopped by SIGTERM; exit 143")


def interrupt_on_sigterm():
    """Make SIGTERM raise :class:`Terminated` in the main thread (after the first, a second
    SIGTERM is ignored while the clean-up runs). Returns the previous handler, or None off the
    main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminate(signum, frame):  # noqa: ANN001
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stops.record(Terminated)
        raise Terminated()

    return signal.signal(signal.SIGTERM, terminate)


def start_forkserver(ctx: Any, preload: Sequence[str]) -> None:
    """Start multiprocessing's forkserver (of ``ctx``, importing ``preload``) unless it runs,
    naming this process and its ``pymp-*`` folder to it, which it removes if this process dies
    without removing it (backends/forkserver_exit.py); deaf to
    SIGINT, as every process it forks is, and to SIGTERM from the moment it starts (it ends when
    this process's pipe closes: forkserver_exit). A terminal's Ctrl-C reaches the whole process group:
    a forkserver still importing its preload (torch, seconds) printed a KeyboardInterrupt
    traceback, and the workers it forks are stopped by the process that started them (the
    pool's stop, ``verify --jobs``' terminate), never by the key. An ignored signal stays
    ignored across exec (a blocked mask does not: the spawn clears it), so SIGINT is ignored
    here for the spawn alone, and blocked meanwhile: on Linux a blocked signal stays pending even
    while ignored, and is delivered when unblocked, so a Ctrl-C in that moment is not lost (SIGTERM
    alike)."""
    import multiprocessing.forkserver

    ctx.set_forkserver_preload([*preload, forkserver_exit.__name__])
    if threading.current_thread() is not threading.main_thread():
        with _owner_named():
            multiprocessing.forkserver.ensure_running()
        return
    stops = {signal.SIGINT, signal.SIGTERM}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        if stops & signal.sigpending():
            return   # Ctrl-C or a stop came already: delivered below, as the mask is restored
        handlers = {signum: signal.signal(signum, signal.SIG_IGN) for signum in stops}
        try:
            with _owner_named():
                multiprocessing.forkserver.ensure_running()
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextlib.contextmanager
def _owner_named():
    """This process and its multiprocessing folder in the environment a forkserver started now
    inherits (forkserver_exit.OWNER), for that start alone. Not in a multiprocessing child: its
    folder is its parent's (a Process carries its parent's settings, the folder among them), the
    parent's to remove; named, the child's forkserver removed it under the living parent when
    the child ended (a `verify --jobs` worker's forkserver of isolated checks)."""
    import multiprocessing
    import multiprocessing.resource_tracker
    import multiprocessing.util

    if multiprocessing.parent_process() is not None:
        yield
        return

    # the forkserver's start begins with the resource tracker's (a process of its own): started
    # first, the folder is made just before the forkserver's spawn, so that a kill can hardly
    # fall between them
    multiprocessing.resource_tracker.ensure_running()
    before = os.environ.get(forkserver_exit.OWNER)
    os.environ[forkserver_exit.OWNER] = forkserver_exit.owner_value(
        os.getpid(), process_start(os.getpid()), multiprocessing.util.get_temp_dir())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(forkserver_exit.OWNER, None)
        else:
            os.environ[forkserver_exit.OWNER] = before


@contextlib.contextmanager
def signals_held():
    """Hold SIGINT and SIGTERM for a process start, which a stop must not cut in two: cut
    after the forkserver forked the child but before the parent knew its pid, the child was
    never killed; it went on to unpickle the pool's semaphores, which the stopping parent had
    unlinked, and printed a FileNotFoundError traceback. A signal that comes meanwhile is
    recorded and raised again, to the handler it had, when the block ends. (Blocking it in the
    main thread is not enough: the kernel hands it to any thread of torch's that does not
    block it, and Python still runs its handler in the main thread.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def defer(signum, frame):  # noqa: ANN001
        caught.append(signum)

    previous = {signum: signal.signal(signum, defer) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def keep_interrupts():
    """Make an interrupt that Python would swallow count: a KeyboardInterrupt (or SIGTERM's
    exit) raised while a weakref callback or ``__del__`` runs is printed as "Exception ignored"
    and lost, and the run went on to exit 0 (1 Ctrl-C in 10 on ``plan --backend gloo``). The
    signal is raised again, and its handler runs in the code that follows. Returns the previous
    ``sys.unraisablehook``."""
    previous = sys.unraisablehook

    def hook(unraisable):  # noqa: ANN001
        exc = unraisable.exc_value
        if isinstance(exc, Terminated) or (isinstance(exc, SystemExit) and exc.code == 128 + signal.SIGTERM):
            again = signal.SIGTERM
        elif isinstance(exc, KeyboardInterrupt):
            again = signal.SIGINT
        else:
            previous(unraisable)
            return
        # raised from here, the handler would run at once, inside this hook, and be swallowed
        # again: a moment later, sent to the main thread (which cuts a wait it is in short), it
        # runs in the main thread's next code
        threading.Timer(0.01, signal.pthread_kill, (threading.main_thread().ident, again)).start()

    sys.unraisablehook = hook
    return previous


@contextlib.contextmanager
def deadline(seconds: float | None, error: Callable[[], BaseException], *,
             only_where: Callable[[FrameType | None], bool] | None = None, hard_after: float | None = None,
             cpu: bool = False):
    """Raise ``error()`` in this (the main) thread after ``seconds``; off the main thread, where
    no signal handler can be set, or with None, no limit.

    ``only_where``: raise only while the interrupted frame passes it (an exception raised inside
    Python code that C++ called cannot cross that C++ frame and aborts the process); until then
    the alarm re-arms every 10 ms, and past ``hard_after`` seconds it is raised wherever it is.
    ``cpu``: seconds of this process's CPU time (every thread's, user and system), not of the
    clock: a budget that says how much work a step may take, whatever else loads the machine."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    timer, signum, clock = ((signal.ITIMER_PROF, signal.SIGPROF, time.process_time) if cpu else
                            (signal.ITIMER_REAL, signal.SIGALRM, time.monotonic))
    hard = None if hard_after is None else clock() + hard_after

    def expire(signum, frame):  # noqa: ANN001
        if only_where is None or only_where(frame) or (hard is not None and clock() > hard):
            raise error()
        signal.setitimer(timer, 0.01)

    previous = signal.signal(signum, expire)
    signal.setitimer(timer, seconds)
    try:
        yield
    finally:
        signal.setitimer(timer, 0)
        signal.signal(signum, previous)
