"""`shardverify audit [SPEC ...]`: is every valid layout combination of an op offered?

For every case of each op spec and every mesh, the audit enumerates the operands' layouts,
decides numerically which combinations the op runs on with no communication (and which
output layout they give), and compares with the strategies the spec generates. Exit status
1 when a strategy is incorrect or a valid combination is missing that the spec's
``audit: accept:`` list (or its generator family's known gaps) does not name; ``--dtensor``
also compares with DTensor's rules.

The report starts with the verdict (PASS or FAIL, the counts, the first failure) and lists every
failing case; -v adds the per-case table, each case's notes and findings, and the DTensor
comparison case by case.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from shardverify.cli import USAGE
from shardverify.cli.audit_cluster import audit_on_cluster
from shardverify.cli.catalogue import checked_op_specs
from shardverify.cli.cluster_option import add_cluster_options, jobs_problem
from shardverify.cli.html_option import add_html_option, html_problem, write_html
from shardverify.cli.progress import Progress
from shardverify.cli.row_warnings import Caught, caught_warnings
from shardverify.cli.verdict import SHOWN, capped, count, shortened, verdict_line, warnings_detail, warnings_note
from shardverify.cli.verify_cmd import one_rank_mesh, parse_mesh
from shardverify.errors import ShardVerifyError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "audit", help="find valid layout combinations the op specs do not offer",
        description="Enumerate every layout combination of each op's operands on each mesh, decide "
                    "numerically which ones are valid without communication, and report the valid "
                    "ones no strategy offers (missing) and offered strategies that are not valid "
                    "(incorrect). Exit status 1 on any incorrect strategy or missing combination "
                    "that neither the spec's `audit: accept:` list nor its generator family's "
                    "known gaps name.")
    parser.add_argument("specs", nargs="*", metavar="SPEC",
                        help="op spec paths or names, e.g. linear (default: every op spec)")
    parser.add_argument("--mesh", action="append", type=parse_mesh, metavar="SHAPE", default=None,
                        help="mesh shape such as 2,2 or 4 (repeatable; default: every mesh of each spec's "
                             "verify: meshes, those its audit: meshes leaves out of the generated test included)")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of the report")
    add_html_option(parser, "the verdict, each case's offered and valid layouts and the written report")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="after the verdict, one row per case and mesh with its notes and findings, and the "
                             "DTensor comparison case by case")
    parser.add_argument("--markdown", action="store_true",
                        help="print the per-op report (offered / valid / missing / accepted with reasons) as Markdown; "
                             "with --dtensor, the comparison per op too")
    parser.add_argument("--dtensor", action="store_true",
                        help="also compare with the output placements DTensor propagates (1-D and 2-D meshes)")
    parser.add_argument("--no-partial-inputs", dest="partial_inputs", action="store_false",
                        help="do not enumerate partial (sum) input layouts")
    parser.add_argument("--show", type=int, default=20, metavar="N",
                        help="with -v: missing/incorrect lines printed per case and mesh (default: 20; JSON has all)")
    add_cluster_options(parser, "cases")
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root (default: .)")
    parser.add_argument("--specs-dir", type=Path, default=None, help="folder holding the specs (default: ROOT/specs)")
    parser.set_defaults(func=run)


def format_table(rows) -> str:
    header = ("op", "case", "mesh", "combos", "decided", "offered", "valid", "covered", "masked", "missing",
              "accepted", "incorrect", "time")
    body = [(r.op, r.case, "x".join(map(str, r.mesh)), str(r.combinations), str(r.decided), str(r.offered),
             str(r.valid), str(r.covered), str(r.masked), str(len(r.missing)), str(len(r.accepted)),
             str(len(r.incorrect)), f"{r.seconds:.2f}s") for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line):
        return "  ".join(cell.ljust(w) if i < 3 else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(line, widths))).rstrip()

    return "\n".join([fmt(header), fmt(tuple("-" * w for w in widths)), *map(fmt, body)])


def _details(rows, show: int) -> list[str]:
    lines = []
    for r in rows:
        if r.error:
            lines.append(f"\n{r.op} {r.case} on mesh {list(r.mesh)}: error: {r.error}")
        if r.note:
            lines.append(f"\n{r.op} {r.case} on mesh {list(r.mesh)}: note: {r.note}")
        for kind, found in (("incorrect", r.incorrect), ("missing", r.missing)):
            if not found:
                continue
            lines.append(f"\n{r.op} {r.case} on mesh {list(r.mesh)}: {len(found)} {kind}")
            lines += [f"  {f.line}" for f in found[:show]]
            if len(found) > show:
                lines.append(f"  ... {len(found) - show} more (--show N or --json)")
    return lines


def run(args: argparse.Namespace) -> int:
    if single := one_rank_mesh(args.mesh):
        print(f"error: {single}", file=sys.stderr)
        return USAGE
    if problem := html_problem(args.html) or jobs_problem(args):
        print(f"error: {problem}", file=sys.stderr)
        return USAGE
    specs = checked_op_specs(args, "audit")
    if specs is None:
        return USAGE
    start = time.perf_counter()
    audited = _audit_rows(args, specs)
    if isinstance(audited, int):
        return audited
    rows, warned = audited
    elapsed = time.perf_counter() - start
    disagreements = []
    if args.dtensor:
        from shardverify.features.dtensor.propagation import compare_specs

        disagreements = compare_specs(specs, args.mesh)
    decided = sum(r.decided for r in rows)
    failed = any(r.failed for r in rows) or decided == 0   # no pass without a combination decided
    per_combo_ms = 1000 * sum(r.seconds for r in rows) / max(decided, 1)
    if args.json:
        document = {"passed": not failed, "seconds": round(elapsed, 3), "decided": decided,
                    "combinations": sum(r.combinations for r in rows),
                    "ms_per_decided_combination": round(per_combo_ms, 4),
                    "rows": [r.to_json() for r in rows]}
        if args.dtensor:
            document["dtensor"] = [d.to_json() for d in disagreements]
        json.dump(document, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return _finished(args, rows, elapsed, failed)
    if args.markdown:
        from shardverify.features.audit.report import markdown_report
        from shardverify.features.dtensor.propagation_report import dtensor_markdown

        print(markdown_report(rows))
        if args.dtensor:
            print("DTensor comparison (fake process group, in-process):\n")
            print(dtensor_markdown(disagreements))
        return _finished(args, rows, elapsed, failed)
    lines = summary_lines(rows, elapsed, verbose=args.verbose)
    if args.dtensor and not args.verbose:
        lines.append(_dtensor_line(disagreements))
    if not args.verbose and (note := warnings_note(warned, "auditing")):
        lines.append(note)
    if args.verbose:
        lines += ["", format_table(rows), *_details(rows, args.show), *warnings_detail(warned, doing="auditing")]
        if args.dtensor:
            from shardverify.features.dtensor.propagation import format_disagreements

            lines += ["", format_disagreements(disagreements)]
    print("\n".join(lines))
    return _finished(args, rows, elapsed, failed)


def _audit_rows(args: argparse.Namespace, specs) -> tuple[list, dict[str, int]] | int:
    """Every case of ``specs`` audited, here or on --cluster, with progress on stderr: the rows and
    the warnings torch gave (counted), or the exit status of a run that stopped."""
    from shardverify.features.audit.run import audit_spec

    rows: list = []
    progress = Progress(0 if args.json else sum(len(spec.cases()) * len(args.mesh or spec.verify.meshes)
                                                for spec in specs))

    caught = Caught()   # the warnings torch gives on the ops' edge cases: counted, not printed (row_warnings)

    def done(found) -> None:
        rows.append(found)
        progress.step()
        with caught.outside():
            progress.show(f"{found.op} {found.case} on mesh {tuple(found.mesh)}")

    try:
        with progress, caught_warnings() as caught:
            if args.cluster is not None:
                audit_on_cluster(args, specs, progress, caught, rows.append)
            else:
                for spec in specs:
                    audit_spec(spec, args.mesh, partial_inputs=args.partial_inputs, on_result=done)
    except ShardVerifyError as exc:   # no cluster to join, workers on other versions
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:   # Ctrl-C: the cases audited so far, no traceback
        if rows and not args.json:
            print(format_table(rows))
        print(f"\nshardverify audit: interrupted after {len(rows)} case(s); exit 130", file=sys.stderr)
        return 130
    return rows, caught.counts


def _finished(args: argparse.Namespace, rows, elapsed: float, failed: bool) -> int:
    """The exit status, the HTML page written first when asked (after the report is on stdout)."""
    sys.stdout.flush()

    def page():
        from shardverify.features.audit.report import markdown_report
        from shardverify.features.report.text_pages import audit_page

        return audit_page(rows, summary_lines(rows, elapsed), markdown_report(rows), not failed)

    if not write_html(page, args.html):
        return USAGE
    return 1 if failed else 0


def summary_lines(rows, seconds: float, *, verbose: bool = False, shown: int = SHOWN) -> list[str]:
    """The verdict (PASS or FAIL with the counts), the first failure, one line for the cases with a
    note, and every failing case (capped; ``verbose``: without the lines that point to -v)."""
    decided = sum(r.decided for r in rows)
    failing = [r for r in rows if r.failed]
    missing = sum(len(r.missing) for r in rows)
    incorrect = sum(len(r.incorrect) for r in rows)
    accepted = sum(len(r.accepted) for r in rows)
    combinations = sum(r.combinations for r in rows)
    what = (f"{count(combinations, 'layout combination')}: {missing:,} valid but not offered, "
            f"{incorrect:,} offered but invalid, {count(accepted, 'known gap')} accepted")
    ms = 1000 * sum(r.seconds for r in rows) / max(decided, 1)
    run = f"{decided:,} run on the op at {ms:.1f} ms each"
    if decided < combinations:
        run += f", the others follow by mesh symmetry{' or were sampled out' if any(r.sampled for r in rows) else ''}"
    context = [f"{count(len({r.op for r in rows}), 'op')}, {count(len({(r.op, r.case) for r in rows}), 'case')}, "
               f"{count(len({tuple(r.mesh) for r in rows}), 'mesh', 'meshes')}", run, f"{seconds:.1f}s"]
    lines = [verdict_line(not failing and decided > 0, what, context)]
    if failing:
        lines += _first_failure(failing[0])
    elif decided == 0:
        lines.append("no combination was run on the op: nothing was checked")
    if not verbose:
        noted = sum(bool(r.note) for r in rows)
        if noted:
            lines.append(f"note: {count(noted, 'case')} audited in part or not at all (what was left out and why: see -v)")
        if failing:
            lines.append(f"failing: {count(len(failing), 'case')} (every finding: -v or --json)")
            lines += capped([f"  {_failing_row(r)}" for r in failing], shown)
    return lines


def _first_failure(row) -> list[str]:
    where = f"{row.op} {row.case} on mesh {tuple(row.mesh)}"
    if row.error:
        return [f"first failure: {where}: the audit could not run", f"  {row.error}"]
    if row.incorrect:
        return [f"first failure: {where}: an offered strategy is not valid", f"  {row.incorrect[0].line}"]
    return [f"first failure: {where}: a valid combination no strategy offers", f"  {row.missing[0].line}"]


def _failing_row(row) -> str:
    where = f"{row.op} {row.case} on mesh {tuple(row.mesh)}"
    if row.error:
        return shortened(f"{where}: could not run: {row.error}")
    return f"{where}: {len(row.missing):,} valid but not offered, {len(row.incorrect):,} offered but invalid"


def _dtensor_line(reports) -> str:
    """The DTensor comparison in one line: its disagreements by kind (each case's: -v)."""
    kinds: dict[str, int] = {}
    for report in reports:
        for d in report.disagreements:
            kinds[d.kind] = kinds.get(d.kind, 0) + 1
    told = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) or "no disagreement"
    return f"DTensor's rules compared on {count(len(reports), 'case')}: {told} (each case: -v)"
