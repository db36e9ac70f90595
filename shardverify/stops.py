"""The stops this process received through shardverify's own handlers (SIGTERM; SIGINT too while
the command starts), kept apart from the exception the handler raises.

That exception can be lost: a handler runs inside whatever Python code was running, and where
that code was called from C (an import's module set-up, a lookup torch makes on a Python object)
the C code may clear the error as a failed lookup and go on. A `dtensor` run sent SIGTERM under
a loaded test suite was still working 600 s later (not reproduced alone). Long loops ask
:func:`raise_if_stopped` before each step, so a lost stop is raised again there.

No imports beyond the standard library: the package's own start-up handler records here.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["record", "clear", "raise_if_stopped"]

_received: list[Callable[[], BaseException]] = []


def record(again: Callable[[], BaseException]) -> None:
    """Called by a stop signal's handler before it raises: ``again()`` makes the exception it
    raises, for :func:`raise_if_stopped`."""
    _received.append(again)


def clear() -> None:
    """Forget the stops received (a command that ran in process returned: the next starts clean)."""
    _received.clear()


def raise_if_stopped() -> None:
    """Raise the exception of the last stop received, if any, again, as its handler did."""
    if _received:
        raise _received[-1]()
