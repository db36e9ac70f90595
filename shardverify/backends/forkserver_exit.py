"""Imported in multiprocessing's forkserver (the last of its preload, see
``signals.start_forkserver``): when the forkserver ends because the process that started it is
gone, it removes that process's multiprocessing ``pymp-*`` folder (which also holds its pools'
store folders).

A process killed by SIGKILL runs no exit handler; its pool workers remove the folder when they
see it gone (``process_worker.watch_parent``). Killed after the forkserver started but before
any worker ran (the forkserver still importing torch), no worker ever runs, and without this
module the folder stayed for good (the gloo run a test stops with SIGKILL left it under load).
The forkserver outlives its starter by design (it ends when the starter's end of a pipe
closes) and its exit handlers run, so the folder is removed there.

The starter names itself in an environment variable set for the forkserver's start alone
(``pid:start:folder``); that value is checked as any stored data is (a number, a number or
nothing, a ``pymp-*`` folder by a normalised absolute path), and the folder is removed only if the
starter is gone, never through a link.
"""

from __future__ import annotations

import atexit
import multiprocessing.forkserver
import os
import shutil
import signal
import sys
import time

from shardverify.backends.liveness import process_alive, process_ended

__all__ = ["OWNER", "owner_value", "parse_owner"]

#: the environment variable naming the forkserver's starter: ``pid:start time:pymp folder``
OWNER = "SHARDVERIFY_FORKSERVER_OWNER"


def owner_value(pid: int, started: int | None, folder: str) -> str:
    """The variable's value for a starter ``pid`` (started at ``started``, see
    ``liveness.process_start``) whose multiprocessing folder is ``folder``."""
    return f"{pid}:{'' if started is None else started}:{folder}"


def parse_owner(value: str) -> tuple[int, int | None, str] | None:
    """(pid, start time or None, folder) of a value ``owner_value`` wrote; None for anything else."""
    pid, _, rest = value.partition(":")
    started, _, folder = rest.partition(":")
    if not pid.isdigit() or (started and not started.isdigit()):
        return None
    if not os.path.isabs(folder) or os.path.normpath(folder) != folder or \
            not os.path.basename(folder).startswith("pymp-"):
        return None
    return int(pid), int(started) if started else None, folder


#: how long the forkserver, ending, waits for its starter to show as ended (see _remove_if_gone)
STARTER_END_SECONDS = 10.0


def _remove_if_gone(pid: int, started: int | None, folder: str) -> None:
    """Remove the starter's folder once the starter has ended (a zombie counts). The forkserver
    ends as its starter's end of the pipe closes, and a process's files close as it exits, before
    it shows as ended: a starter killed then (an xdist worker its controller kills after a group
    SIGTERM) was found still there, its folder left to it, and it removed nothing. So the end is
    waited for; a starter still there after ``STARTER_END_SECONDS`` lives on, its folder its own."""
    deadline = time.monotonic() + STARTER_END_SECONDS
    while process_alive(pid, started) and not process_ended(pid):
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
    if not os.path.islink(folder):
        shutil.rmtree(folder, ignore_errors=True)


def _in_forkserver() -> bool:
    """Whether this module is being imported as the forkserver's preload (inside
    ``multiprocessing.forkserver.main``), not by a process that only reads its names: importing
    the verify engine imports this module (backends/signals.py), and its set-up below, run there,
    made every program importing the library ignore SIGTERM (a benchmark went on 20 minutes past
    two SIGTERMs)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is multiprocessing.forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _register() -> None:
    owner = parse_owner(os.environ.pop(OWNER, ""))   # popped: the processes it forks never see it
    if owner is not None:   # (the starter may be gone already: killed while torch was imported here)
        atexit.register(_remove_if_gone, *owner)
    _outlive_a_group_stop()


def _outlive_a_group_stop() -> None:
    """A SIGTERM to the whole process group (`kill -- -PGID`, a CI timeout, pytest-xdist stopping
    its workers) ends the forkserver no more than it ends the pool workers (process_worker): it
    ends when its starter's pipe closes, so its exit handlers run and remove what a starter killed
    before its own ran left (ended by the signal, it ran none: an xdist worker's folder stayed,
    with no process left, in a loaded run of the stopped-run test). It is started ignoring SIGTERM
    (signals.start_forkserver: a stop while it imports torch must not end it either); ignored here
    too for a start from another thread. What it forks gets SIGTERM's default action back."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))


if _in_forkserver():
    _register()
