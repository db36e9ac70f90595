"""Where this process's threads run: the CPUs it may use, and keeping a thread on one of them.

Kept in one place for the three callers that place work (the simulated backend's rank
threads, the process pools' workers, `verify --jobs` workers): Linux has the calls, other
platforms have none of them, and a placement that fails costs speed, never a check.
"""

from __future__ import annotations

import os

__all__ = ["can_keep", "keep_to_cpu", "usable_cpus"]


def can_keep() -> bool:
    """Whether this platform can keep a thread on chosen CPUs (Linux's sched_setaffinity)."""
    return hasattr(os, "sched_setaffinity")


def usable_cpus() -> list[int]:
    """The CPUs this thread may run on, sorted (every CPU where the platform does not say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


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
