"""Whether a process is still the one it was: a pid and the time it started.

A busy machine hands a dead process's pid to a new one within minutes (pid_max 32768), so a pid
alone cannot say that its owner lives: a pool worker watching its parent, or a lock naming the
process that holds it, also keeps the owner's start time (``/proc/PID/stat`` field 22) and takes
a pid that started at another time for a dead owner."""

from __future__ import annotations

import os

__all__ = ["process_start", "process_alive", "session_processes"]


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux's /proc), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_alive(pid: int | None, started: int | None = None) -> bool:
    """Whether a process ``pid`` exists (a zombie not yet reaped still does) and, when ``started``
    is known, is the one that started then (not a stranger that reused its pid)."""
    if pid is None or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except (OverflowError, OSError):
        return False
    return started is None or process_start(pid) in (None, started)


def session_processes(sid: int) -> set[int]:
    """The processes of session ``sid`` (Linux's /proc; empty elsewhere): a run started in a
    session of its own keeps it in every process it leaves, a forkserver's re-parented children
    and a killed leader's orphans alike."""
    found = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    if int(handle.read().rsplit(")", 1)[1].split()[3]) == sid:
                        found.add(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found
