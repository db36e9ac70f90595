"""The pieces of a verdict-first report, shared by `verify`, `audit` and `dtensor`: the first line
says PASS or FAIL with the run's counts, a few lines follow, and the detail is behind -v and --json.

Every list of failures a short report prints is capped (``capped``), its last line saying how many
more there are and where to see them: a failure is never left out without that line.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SHOWN", "count", "verdict_line", "capped", "shortened", "warnings_note", "warnings_detail"]

#: failing items a short report lists before "and N more: see -v"
SHOWN = 20


def count(number: int, word: str, many: str | None = None) -> str:
    """``count(1, "op")`` -> ``"1 op"``, ``count(72013, "check")`` -> ``"72,013 checks"``."""
    return f"{number:,} {word if number == 1 else many or word + 's'}"


def verdict_line(passed: bool, what: str, context: Sequence[str]) -> str:
    """``PASS  <what>  (<context>; <context>)``: the first line of a report."""
    return f"{'PASS' if passed else 'FAIL'}  {what}" + (f"  ({'; '.join(context)})" if context else "")


def capped(lines: Sequence[str], shown: int = SHOWN, where: str = "see -v") -> list[str]:
    """The first ``shown`` of ``lines``, then one line counting the rest and saying ``where``
    they are."""
    if len(lines) <= shown:
        return list(lines)
    return [*lines[:shown], f"  and {len(lines) - shown:,} more: {where}"]


def shortened(text: str, limit: int = 200) -> str:
    """``text`` on one line, cut at ``limit`` characters (the rest: see -v)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 12].rstrip() + " ... (see -v)"


def warnings_note(counts: dict[str, int], doing: str = "checking") -> str:
    """The warnings torch gave (message -> count, cli/row_warnings.py) in one line however many
    ("" when none): the specs call ops on edge cases on purpose, and torch warns about some."""
    if not counts:
        return ""
    first = max(counts, key=lambda message: counts[message])
    first = first if len(first) <= 70 else first[:67].rstrip() + "..."
    which = f"{count(len(counts), 'distinct warning')}, most often {first!r}" if len(counts) > 1 else repr(first)
    return f"note: torch warned {count(sum(counts.values()), 'time')} while {doing} ({which}): see -v"


def warnings_detail(counts: dict[str, int], where: dict[str, list[str]] | None = None,
                    doing: str = "checking") -> list[str]:
    """The -v list of those warnings, the most frequent first, each with (up to three of) ``where``
    it was given."""
    if not counts:
        return []
    lines = ["", f"warnings torch gave while {doing} (the specs call ops on edge cases on purpose):"]
    for message, times in sorted(counts.items(), key=lambda item: -item[1]):
        places = (where or {}).get(message, [])
        said = ", ".join(places[:3]) + (f" and {len(places) - 3} more" if len(places) > 3 else "")
        lines.append(f"  {times} x {message}" + (f" ({said})" if said else ""))
    return lines
