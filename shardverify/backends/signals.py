"""SIGTERM as an exception, so that a checking process stopped by ``kill`` or a CI timeout
cleans up like one stopped by Ctrl-C.

The default action of SIGTERM ends the process at once: its ``finally`` blocks and exit handlers
never run, and the worker pools, forkservers, resource trackers, shared-memory semaphores and
temp folders they would have stopped or removed are left behind. Raised as ``SystemExit(143)``
in the main thread, they run.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["exit_on_sigterm"]


def exit_on_sigterm():
    """Make SIGTERM raise ``SystemExit(128 + SIGTERM)`` in the main thread. Returns the previous
    handler (to restore), or None off the main thread, where no handler can be set."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminate(signum, frame):  # noqa: ANN001
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, terminate)
