"""The progress line of the long commands (shardverify/cli/progress.py): drawn in place with an
estimate of the time left on a terminal, and silent on anything else."""

from __future__ import annotations

import io

from shardverify.cli.progress import Progress, clock_time


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr does in an interactive shell."""

    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_terminal_gets_one_line_redrawn_with_the_time_left():
    clock, stream = Clock(), Terminal()
    progress = Progress(4, stream, clock=clock)
    progress.show("sum case a")
    assert stream.getvalue() == "\r[....................] 0/4   0%  0s elapsed, ETA --  sum case a"
    clock.now += 10
    progress.step()
    progress.show("sum case b")
    last = stream.getvalue().split("\r")[-1]
    assert last.startswith("[#####...............] 1/4  25%  10s elapsed, ETA 30s  sum case b")
    clock.now += 80
    progress.step(2)
    progress.show()        # a shorter line: spaces wipe what the longer one left
    last = stream.getvalue().split("\r")[-1]
    assert last.rstrip() == "[###############.....] 3/4  75%  1m30s elapsed, ETA 30s"
    assert len(last) == len("[#####...............] 1/4  25%  10s elapsed, ETA 30s  sum case b")
    progress.close()
    assert stream.getvalue().endswith("\r" + " " * len(last.rstrip()) + "\r") and "\n" not in stream.getvalue()


def test_nothing_is_written_where_stderr_is_not_a_terminal():
    pipe, terminal = io.StringIO(), Terminal()
    for stream, total in ((pipe, 4), (terminal, 1)):     # a pipe; a terminal, but a run of one item
        with Progress(total, stream) as progress:
            progress.show("sum case")
            progress.step()
            progress.show("sum case")
    assert pipe.getvalue() == terminal.getvalue() == ""


def test_a_long_label_is_cut_to_the_terminal_width():
    stream = Terminal()
    progress = Progress(3, stream)
    progress.show("x" * 500)
    assert 20 < len(stream.getvalue()) <= 80     # StringIO has no terminal size: 80 columns


def test_clock_time():
    assert [clock_time(s) for s in (0.2, 8.4, 59.6, 75, 3599, 3725)] == ["0s", "8s", "1m00s", "1m15s", "59m59s",
                                                                          "1h02m"]
