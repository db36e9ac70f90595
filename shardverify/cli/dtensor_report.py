"""`shardverify dtensor`'s report on stdout and its verdict: the PASS or FAIL line with the counts,
what was not checked and why, the classes found, and the parts of a run that decide whether it
passes. Shared by a run and by ``--from-json``, so both say the same of the same results."""

from __future__ import annotations

import argparse

from shardverify.cli.verdict import count, verdict_line, warnings_detail, warnings_note

__all__ = ["report_lines", "unchecked_reasons", "budget_cut", "passes"]


def report_lines(args: argparse.Namespace, results, accepted, confirmations, passed: bool, source: str,
                 about: str = "", warned: dict[str, int] | None = None, gated: list[str] | None = None) -> list[str]:
    """The report, verdict first: PASS or FAIL with the counts (``source``: the time a run took,
    or where its results were read), the first new class, what was not checked and why, ``about``
    the results, the classes found (at most --show of each kind), one line for the cases' notes and
    one for the warnings torch gave (``warned``); -v adds the per-case table, the notes and the
    warnings."""
    from shardverify.features.dtensor.report import case_notes, case_table, class_lines, new_class_name, new_classes
    from shardverify.features.dtensor.rootcause import severity_of

    fresh = new_classes(results, accepted)
    unchecked = unchecked_reasons(results)
    cut, skipped = budget_cut(results)
    executed = sum(r.executed for r in results)
    rounding = sum(f.klass == "silent-wrong" and severity_of(f) == "rounding" for r in results for f in r.findings)
    silent = sum(r.counts.get("silent-wrong", 0) for r in results) - rounding
    late = sum(r.counts.get("late-failure", 0) for r in results)
    what = (f"{count(executed, 'layout combination')} run on DTensor: {silent:,} silently wrong"
            + (f" ({rounding:,} more within rounding)" if rounding else "") + f", {late:,} failing "
            f"later, {count(len(fresh), 'new class', 'new classes')} not in the accepted file"
            + ("; no combination was executed" if unchecked else "") + _gloo_verdict(confirmations))
    context = [f"{count(len({r.op for r in results}), 'op')}, {count(len({(r.op, r.case) for r in results}), 'case')}, "
               f"{count(len({tuple(r.mesh) for r in results}), 'mesh', 'meshes')}", source]
    lines = [verdict_line(passed, what, context)]
    if fresh:
        first = fresh[0]
        lines.append(f"first new class: {new_class_name(first, accepted)}: e.g. {first.case} on {tuple(first.mesh)}: "
                     f"{first.line}: {first.detail}")
    lines += gated or []
    if skipped:
        lines.append(_skipped_words(skipped, args.sample_passes).removeprefix(", "))
    lines += [f"  not checked: {line}" for line in unchecked + cut]
    if about:
        lines.append(about)
    lines += class_lines(results, accepted, args.show, confirmations, blank=False)
    notes = case_notes(results)
    if args.verbose:
        lines += ["", *case_table(results), *notes, *warnings_detail(warned or {}, doing="running DTensor")]
        return lines
    if notes:
        lines.append(f"note: {count(len(notes), 'case')} with a note (combinations left out, or an error): see -v")
    if note := warnings_note(warned or {}, "running DTensor"):
        lines.append(note)
    return lines


def unchecked_reasons(results) -> list[str]:
    """Why the run checked nothing, when it did not: a run without one executed combination is
    never a pass (the cases' notes say what stopped each)."""
    if any(r.executed for r in results):
        return []
    if not results:
        return ["no case was run"]
    return [f"{r.op} {r.case} on {list(r.mesh)}: {r.note or 'no combination executed'}"[:300] for r in results]


def budget_cut(results) -> tuple[list[str], int]:
    """The cases the time budget cut short, one line each, and how many combinations it left
    unchecked in all (a sample the budget chose is no pass unless --sample-passes says so)."""
    from shardverify.features.dtensor.run import budget_skipped

    lines, total = [], 0
    for r in results:
        if skipped := budget_skipped(r):
            total += skipped
            lines.append(f"{r.op} {r.case} on {list(r.mesh)}: {skipped} combination(s) skipped by the time budget")
    return lines, total


def _skipped_words(skipped: int, sample_passes: bool) -> str:
    if not skipped:
        return ""
    return (f", {skipped} combination(s) skipped by the time budget"
            + (" (passed on the sample checked: --sample-passes)" if sample_passes else
               " (no pass on a sample: raise --budget, or --sample-passes)"))


def _unreproduced(confirmations) -> list[str]:
    return [k for k, c in (confirmations or {}).items() if c.status == "not reproduced"]


def _gloo_verdict(confirmations) -> str:
    """The verdict line's part on real gloo processes: classes run there, confirmed, not reproduced."""
    if not confirmations:
        return ""
    missed = _unreproduced(confirmations)
    confirmed = sum(c.status == "confirmed" for c in confirmations.values())
    return (f"; of {len(confirmations)} class(es) run on real gloo processes {confirmed} confirmed"
            + (f", {len(missed)} NOT REPRODUCED" if missed else ""))


def passes(args: argparse.Namespace, fresh, unchecked, cut, confirmations=None, gated=None) -> bool:
    """The verdict: no new class, a combination executed, every class run on gloo reproduced, no
    case cut by the budget (unless --sample-passes), and nothing failing --gate (its last line only
    says what it watched)."""
    return (not fresh and not unchecked and not _unreproduced(confirmations) and (not cut or args.sample_passes)
            and len(gated or [""]) == 1)
