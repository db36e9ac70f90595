"""Whether a process is still the one it was: a pid and the time it started.

A busy machine hands a dead process's pid to a new one within minutes (pid_max 32768), so a pid
alone cannot say that its owner lives: a pool worker watching its parent, or a lock naming the
process that holds it, also keeps the owner's start time (``/proc/PID/stat`` field 22) and takes
a pid that started at another time for a dead owner."""

from __future__ import annotations

import os

__all__ = ["process_start", "process_alive", "process_ended", "session_processes", "session_cpu_seconds"]


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command's name (field 3 on: the state first),
    None where there is no such process or no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux's /proc), None where unknown."""
    fields = _stat_fields(pid)
    try:
        return None if fields is None else int(fields[19])
    except (IndexError, ValueError):
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
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    found = set()
    for entry in entries:
        fields = _stat_fields(entry) if entry.isdigit() else None
        try:
            if fields is not None and int(fields[3]) == sid:
                found.add(int(entry))
        except (IndexError, ValueError):
            continue
    return found


def session_cpu_seconds(sid: int) -> float:
    """CPU seconds the live processes of session ``sid`` have used (a process that ended takes its
    share with it): whether a run started in a session of its own is still working, on a machine
    too loaded to say so by the clock."""
    ticks = 0
    for pid in session_processes(sid):
        fields = _stat_fields(pid)
        try:
            ticks += 0 if fields is None else int(fields[11]) + int(fields[12])
        except (IndexError, ValueError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def process_ended(pid: int) -> bool:
    """Whether ``pid`` has ended and waits to be reaped (a zombie, which ``process_alive`` still
    counts: its parent may not have seen it end yet)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] in ("Z", "X")
