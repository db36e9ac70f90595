"""The warnings torch gives while a `verify` row (or an `audit` or `dtensor` run) runs, caught and
counted instead of printed.

The specs check ops on edge cases on purpose (a variance over one element, a deprecated argument
form), and torch warns about each call: printed, a run over every spec wrote over a hundred such
lines around its report. A row keeps them as {message: count}, for the report to count in one line
and list under -v.

Two kinds are caught: Python warnings (``warnings.catch_warnings``), and the lines torch's C++
side writes straight to the process's stderr when an op is called through ``torch.ops`` (no
Python warning handler is active there): those are caught by pointing file descriptor 2 at a
file of this process while the row runs (``descriptor=True``; only for rows checked in this
process, as a process started meanwhile keeps the descriptor it was given). Every other line
written to stderr meanwhile is written to the real stderr when the row ends, so nothing else is
lost. What must reach the terminal while the block runs (a progress line) is written inside
``Caught.outside()``.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator

__all__ = ["Caught", "caught_warnings"]

#: how torch ends a C++ warning's text: the function that gave it (``operator()`` included)
_FUNCTION_NAMED = r" \(function (?:[^()]|\(\))*\)"
#: a warning line of torch's C++ logging, e.g. "[W1202 20:36:35.556572433 ReduceOps.cpp:1861]
#: Warning: var(): degrees of freedom is <= 0. ... (function warn_invalid_degrees_of_freedom)"
_CPP_WARNING = re.compile(r"^(?:\[rank\d+\]:)?\[W\d{4} [\d:.]+ [^\]]*\] Warning: (?P<message>.*?)(?:" + _FUNCTION_NAMED + r")?$")
#: a message of several lines (torch.cholesky's deprecation shows the code to write instead) runs on
#: to the line naming the function, and is counted as one line (a report's note quotes it)
_FUNCTION = re.compile(_FUNCTION_NAMED + "$")
#: the most lines one C++ warning's message is read over before its first line is taken alone
_MOST_LINES = 64
#: a Python warning as a child process started during a row prints it (an isolated check's), then
#: the line of source it names, indented: "FILE:LINE: UserWarning: MESSAGE"
_PY_WARNING = re.compile(r"^\S.*:\d+: (?P<category>\w*Warning): (?P<message>.*)$")

#: where in torch's C++ source a warning was given, as torch appends it to the Python warning
_WHERE = re.compile(r" \(Triggered internally at [^)]*\)\.?$")

_FILE: list[int] = []   # this process's capture file, opened once (a descriptor; the file is unlinked)


class Caught:
    """The warnings caught so far (``counts``: message -> count), and the way out to the real stderr."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._real: int | None = None      # the real stderr's descriptor while descriptor 2 is caught
        self._capture: int | None = None

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Descriptor 2 is the real stderr inside the block (a progress line, a line per case)."""
        if self._real is None:
            yield
            return
        sys.stderr.flush()
        os.dup2(self._real, 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(self._capture, 2)


@contextlib.contextmanager
def caught_warnings(descriptor: bool = True) -> Iterator[Caught]:
    """Count the warnings given inside the block by message; ``descriptor``: also those torch's C++
    side writes to file descriptor 2."""
    caught = Caught()
    with warnings.catch_warnings(record=True) as recorded, _descriptor_caught(caught, descriptor):
        warnings.simplefilter("always")
        try:
            yield caught
        finally:
            for item in recorded:
                caught.counts[_key(item.category.__name__, str(item.message))] += 1


@contextlib.contextmanager
def _descriptor_caught(caught: Caught, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    try:
        capture = _capture_file()
        sys.stderr.flush()
        real = os.dup(2)
    except (OSError, ValueError):   # no stderr descriptor (a closed one, an embedding): nothing to catch
        yield
        return
    os.dup2(capture, 2)
    caught._real, caught._capture = real, capture
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(real, 2)
        os.close(real)
        caught._real = caught._capture = None
        _sort_out(capture, caught.counts)


def _key(category: str, message: str) -> str:
    """A warning as counted: its message (after its category, unless a plain UserWarning), without
    the C++ source torch names (a Python warning names it, the same one from C++ does not)."""
    message = _WHERE.sub("", message.strip())
    return message if category == "UserWarning" else f"{category}: {message}"


def _capture_file() -> int:
    if not _FILE:
        handle, path = tempfile.mkstemp(prefix="shardverify-stderr-")
        os.unlink(path)   # nothing left on disk, whatever ends the process
        os.set_inheritable(handle, False)
        _FILE.append(handle)
    return _FILE[0]


def _last_line(lines: list[str], start: int) -> int | None:
    """The index of the line, from ``start`` on, that ends a C++ warning begun on the line before
    (naming torch's function); None where another warning, or the end of what is read, comes first."""
    for index in range(start, min(len(lines), start + _MOST_LINES)):
        line = lines[index].rstrip("\n")
        if _CPP_WARNING.match(line):
            return None
        if _FUNCTION.search(line):
            return index
    return None


def _sort_out(capture: int, found: Counter) -> None:
    """Count the captured warning lines into ``found``, write every other line to stderr, and empty
    the file for the next row."""
    size = os.fstat(capture).st_size
    text = os.pread(capture, size, 0).decode(errors="replace") if size else ""
    os.ftruncate(capture, 0)
    os.lseek(capture, 0, os.SEEK_SET)
    passed: list[str] = []
    source = False   # the line after a Python warning: its source line
    lines = text.splitlines(keepends=True)
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if source and line.startswith("  "):
            source = False
            continue
        source = False
        bare = line.rstrip("\n")
        if match := _CPP_WARNING.match(bare):
            message = match["message"]
            if not _FUNCTION.search(bare):   # its message goes on to the line naming the function
                last = _last_line(lines, index)
                if last is not None:
                    message = " ".join([message, *(item.rstrip("\n") for item in lines[index:last]),
                                         _FUNCTION.sub("", lines[last].rstrip("\n"))])
                    index = last + 1
            found[_key("UserWarning", message)] += 1
        elif match := _PY_WARNING.match(bare):
            found[_key(match["category"], match["message"])] += 1
            source = True
        else:
            passed.append(line)
    if passed:
        os.write(2, "".join(passed).encode())
