"""A one-line progress indicator for the commands that run long (`verify`, `audit`, `dtensor`,
`plan`): done/total, percent, elapsed time and an estimate of the time left, redrawn in place with
a carriage return while stderr is a terminal, and silent anywhere else (a pipe, a file, CI, a
test's captured stream), so that logs and parsed output never hold it.

Usage: ``progress = Progress(total)``; ``progress.show(label)`` as an item starts (or ends),
``progress.step()`` as one ends, ``progress.close()`` (or a ``with`` block) to erase the line
before the report is printed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

__all__ = ["Progress", "clock_time"]


def clock_time(seconds: float) -> str:
    """``75.4`` -> ``"1m15s"``, ``3725`` -> ``"1h02m"``, ``8.2`` -> ``"8s"``."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """done/total of a run on one line of ``stream`` (default: stderr), only when it is a terminal.

    The estimate of the time left assumes the items left take as long on average as those done
    (none is given before the first item is done). ``clock`` is for tests."""

    def __init__(self, total: int, stream=None, *, clock: Callable[[], float] = time.monotonic) -> None:
        stream = sys.stderr if stream is None else stream   # looked up now: it may have been replaced
        self.total, self.done, self.stream, self.clock = total, 0, stream, clock
        self.enabled = total > 1 and _is_terminal(stream)
        self.started = clock()
        self._drawn = 0   # characters of the line on screen, to erase

    def line(self, label: str = "") -> str:
        """The text of the progress line, without the carriage return."""
        total = max(self.total, 1)
        done = min(self.done, total)
        elapsed = self.clock() - self.started
        left = f"ETA {clock_time(elapsed / done * (total - done))}" if done else "ETA --"
        filled = 20 * done // total
        text = (f"[{'#' * filled}{'.' * (20 - filled)}] {done}/{total} {100 * done // total:3d}%  "
                f"{clock_time(elapsed)} elapsed, {left}")
        return f"{text}  {label}" if label else text

    def show(self, label: str = "") -> None:
        """Redraw the line, naming ``label`` (the item running or just done)."""
        if not self.enabled:
            return
        text = self.line(label)[:_columns(self.stream) - 1]
        self.stream.write("\r" + text.ljust(self._drawn))
        self.stream.flush()
        self._drawn = len(text)

    def step(self, count: int = 1) -> None:
        """``count`` more items done (drawn at the next ``show``)."""
        self.done += count

    def close(self) -> None:
        """Erase the line, so what is printed next starts at the left margin of a clean line."""
        if self.enabled and self._drawn:
            self.stream.write("\r" + " " * self._drawn + "\r")
            self.stream.flush()
            self._drawn = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):   # no isatty, or a closed stream
        return False


def _columns(stream) -> int:
    """The terminal's width (80 when it cannot be told: no size, or a size of 0; at least 20)."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):   # io.UnsupportedOperation is both of the last two
        return 80
    return max(columns, 20) if columns > 0 else 80
