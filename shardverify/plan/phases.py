"""Where a plan check's CPU time goes: build, capture, strategies, solve, check.

A phase's figure is CPU seconds of this process and of the child processes it waited for (the
ILP solver runs as one, a pool's workers are reaped when it closes), never the wall clock, which
on a loaded machine says more about the load than about the work. ``plan --json`` reports them
(``cpu_seconds``) and benchmarks/bench_plan_phases.py sets them side by side.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["PHASES", "cpu_seconds", "PhaseClock"]

#: the phases of a plan check, in the order they run
PHASES = ("build", "capture", "strategies", "solve", "check")


def cpu_seconds() -> float:
    """CPU seconds (user and system) of this process and of its reaped children."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class PhaseClock:
    """CPU seconds per phase; a phase timed twice adds up. ``on_start`` is told each phase's name
    as it begins (the command's status line on a terminal)."""

    def __init__(self, on_start: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.on_start = on_start

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown plan phase {name!r}; the phases are {', '.join(PHASES)}")
        if self.on_start is not None:
            self.on_start(name)
        began = cpu_seconds()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + cpu_seconds() - began

    def split(self) -> tuple[tuple[str, float], ...]:
        """(phase, seconds) in the order the phases run, those timed only."""
        return tuple((name, self.seconds[name]) for name in PHASES if name in self.seconds)
