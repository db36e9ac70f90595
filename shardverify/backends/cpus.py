"""Where this process's threads run: the CPUs it may use, and keeping a thread on one of them.

Kept in one place for the callers that place work (the simulated backend's rank threads,
the process pools' workers, `verify --jobs` workers, pytest-xdist workers): Linux has the
calls, other platforms have none of them, and a placement that fails costs speed, never a
check.
"""

from __future__ import annotations

import os

from shardverify.errors import InvalidArgument

__all__ = ["can_keep", "keep_to_cpu", "thread_share", "usable_cpus"]


def can_keep() -> bool:
    """Whether this platform can keep a thread on chosen CPUs (Linux's sched_setaffinity)."""
    return hasattr(os, "sched_setaffinity")


def usable_cpus() -> list[int]:
    """The CPUs this thread may run on, sorted (every CPU where the platform does not say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def thread_share(processes: int) -> int:
    """torch's intra-op threads for one of ``processes`` busy processes sharing this process's
    CPUs: an equal share, at least one.  More threads than CPUs do not add speed: an
    OpenMP team waits for its slowest member at every parallel region, and a member whose CPU
    another process holds makes the whole team spin there (the audit and property tests
    under ``pytest -n 4`` on 2 cores: 164 s with torch's default of a thread per core, 113 s
    with one)."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise InvalidArgument(f"processes={processes!r} must be a positive int")
    return max(1, len(usable_cpus()) // processes)


def keep_to_cpu(cpu: int | None, thread: int = 0) -> bool:
    """Keep ``thread`` (a native thread id; 0: the calling thread, whose later threads inherit
    it) on ``cpu``; whether that was done.  None, a platform without the call, a thread gone
    or a CPU no longer ours: nothing changes, and only speed is lost."""
    if cpu is None or not can_keep():
        return False
    try:
        os.sched_setaffinity(thread, {cpu})
    except OSError:
        return False
    return True
