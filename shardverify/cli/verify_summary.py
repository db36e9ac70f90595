"""`shardverify verify`'s report, verdict first: PASS or FAIL with the counts, the first failure
(op, case, mesh, strategy, then the rank, tensor and error against the tolerance), one line for
the cases that check no sharding, one for the warnings torch gave, and every failing case (capped,
the rest counted); the per-case table, every failure's full report and each warning are the -v
detail."""

from __future__ import annotations

from shardverify.cli.progress import clock_time
from shardverify.cli.verdict import SHOWN, capped, count, shortened, verdict_line, warnings_detail, warnings_note
from shardverify.cli.verify_rows import Row, replicated_note, replicated_summary

__all__ = ["outcome", "summary_lines", "detail_lines", "format_table"]


def outcome(rows: list[Row]) -> tuple[int, int]:
    """(strategy checks, failures); no pass without a check: a run that verified no strategy
    counts every row (at least one) as failed, its rows saying why."""
    checks = sum(r.verified for r in rows)
    return checks, sum(r.failures for r in rows) or (0 if checks else max(len(rows), 1))


def summary_lines(rows: list[Row], backend: str, seconds: float, *, verbose: bool = False,
                  shown: int = SHOWN) -> list[str]:
    """The short report. ``verbose``: without the lines that point to -v (its detail follows)."""
    checks, failed = outcome(rows)
    what = f"{count(checks, 'strategy check')}, {count(failed, 'failure')}"
    if not checks:
        what += ": nothing was checked"
    context = [f"{count(len({r.op for r in rows}), 'op')}, {count(len({(r.op, r.case) for r in rows}), 'case')}, "
               f"{count(len({tuple(r.mesh) for r in rows}), 'mesh', 'meshes')}", f"{backend} backend",
               clock_time(seconds) if seconds >= 60 else f"{seconds:.1f}s"]
    lines = [verdict_line(not failed, what, context)]
    failing = [r for r in rows if r.failures]
    if failed:
        lines += _first_failure(failing)
    if not verbose:
        if note := replicated_note(rows):
            lines.append(note)
        if note := warnings_note(_warnings(rows)[0]):
            lines.append(note)
        if failing:
            lines.append(f"failing: {count(len(failing), 'case')} (every report: -v or --json)")
            lines += capped([f"  {_failing_row(r)}" for r in failing], shown)
    return lines


def detail_lines(rows: list[Row]) -> list[str]:
    """The -v detail: the table, the cases that check no sharding, the warnings torch gave, and each
    failure's full report."""
    from shardverify.verify.report import format_results

    lines = ["", format_table(rows)]
    if replicated := replicated_summary(rows):
        lines += ["", *replicated]
    lines += warnings_detail(*_warnings(rows))
    for row in rows:
        if row.error:
            lines += ["", f"{row.op} {row.case} on mesh {tuple(row.mesh)}: FAILED: {row.error}"]
        if any(not r.passed for r in row.results):
            lines += ["", format_results(row.results)]
    return lines


def format_table(rows: list[Row]) -> str:
    """One line per case and mesh: strategies checked, failures, time."""
    header = ("op", "case", "mesh", "strategies", "failures", "time")
    body = [(r.op, r.case, "x".join(map(str, r.mesh)), str(r.verified), str(r.failures), f"{r.seconds:.2f}s")
            for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    right = {3, 4, 5}

    def fmt(line):
        return "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(line, widths))).rstrip()

    return "\n".join([fmt(header), fmt(tuple("-" * w for w in widths)), *map(fmt, body)])


def _warnings(rows: list[Row]) -> tuple[dict[str, int], dict[str, list[str]]]:
    """The warnings torch gave over the rows: message -> count, and message -> the rows it was given in."""
    counts: dict[str, int] = {}
    where: dict[str, list[str]] = {}
    for row in rows:
        for message, times in row.torch_warnings.items():
            counts[message] = counts.get(message, 0) + times
            where.setdefault(message, []).append(f"{row.op} {row.case} on mesh {tuple(row.mesh)}")
    return counts, where


def _first_failure(failing: list[Row]) -> list[str]:
    """The first failing case in run order, as lines 2 and 3 of the report."""
    if not failing:
        return ["no strategy was checked: the cases had none to check (see -v)"]
    row = failing[0]
    where = f"{row.op} {row.case} on mesh {tuple(row.mesh)}"
    if row.error:
        return [f"first failure: {where}: the case could not run", f"  {row.error}"]
    result = next(r for r in row.results if not r.passed)
    first, *others = _in_report_order(result.mismatches)
    more = f" (and {count(len(others), 'more mismatch', 'more mismatches')}: see -v)" if others else ""
    return [f"first failure: {where}, strategy {result.strategy!r}", f"  {first.describe()}{more}"]


def _in_report_order(mismatches) -> list:
    """As a full report lists them (kind, then tensor as the check met it, then rank), so the first
    one shown is the first of the report -v prints."""
    from shardverify.verify.report import KINDS

    first_seen: dict[str, int] = {}
    for mismatch in mismatches:
        first_seen.setdefault(mismatch.tensor, len(first_seen))
    return sorted(mismatches, key=lambda m: (KINDS.index(m.kind), first_seen[m.tensor], m.rank))


def _failing_row(row: Row) -> str:
    where = f"{row.op} {row.case} on mesh {tuple(row.mesh)}"
    if row.error:
        return shortened(f"{where}: could not run: {row.error}")
    names = [r.strategy for r in row.results if not r.passed]
    listed = ", ".join(repr(name) for name in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{where}: {len(names)} of {count(row.verified, 'strategy', 'strategies')} failed: {listed}"
