"""SIGTERM as an exception, so that a checking process stopped by ``kill`` or a CI timeout
cleans up like one stopped by Ctrl-C; and a time limit raised as an exception (SIGALRM).

The default action of SIGTERM ends the process at once: its ``finally`` blocks and exit handlers
never run, and the worker pools, forkservers, resource trackers, shared-memory semaphores and
temp folders they would have stopped or removed are left behind. Raised as ``SystemExit(143)``
in the main thread, they run.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable

__all__ = ["Terminated", "exit_on_sigterm", "interrupt_on_sigterm", "deadline"]


def exit_on_sigterm():
    """Make SIGTERM raise ``SystemExit(128 + SIGTERM)`` in the main thread. Returns the previous
    handler (to restore), or None off the main thread, where no handler can be set."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminate(signum, frame):  # noqa: ANN001
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
        raise Terminated()

    return signal.signal(signal.SIGTERM, terminate)


@contextlib.contextmanager
def deadline(seconds: float | None, error: Callable[[], BaseException]):
    """Raise ``error()`` in this (the main) thread after ``seconds``; off the main thread, where
    no signal handler can be set, or with None, no limit."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):  # noqa: ANN001
        raise error()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
