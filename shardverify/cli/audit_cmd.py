"""`shardverify audit [SPEC ...]`: is every valid layout combination of an op offered?

For every case of each op spec and every mesh, the audit enumerates the operands' layouts,
decides numerically which combinations the op runs on with no communication (and which
output layout they give), and compares with the strategies the spec generates. Exit status
1 when a strategy is incorrect or a valid combination is missing that the spec's
``audit: accept:`` list (or its generator family's known gaps) does not name; ``--dtensor``
also compares with DTensor's rules.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from shardverify.cli import USAGE
from shardverify.cli.verify_cmd import one_rank_mesh, parse_mesh
from shardverify.cli.catalogue import load_op_specs
from shardverify.errors import SpecError


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
    parser.add_argument("--markdown", action="store_true",
                        help="print the per-op report (offered / valid / missing / accepted with reasons) as Markdown; "
                             "with --dtensor, the comparison per op too")
    parser.add_argument("--dtensor", action="store_true",
                        help="also compare with the output placements DTensor propagates (1-D and 2-D meshes)")
    parser.add_argument("--no-partial-inputs", dest="partial_inputs", action="store_false",
                        help="do not enumerate partial (sum) input layouts")
    parser.add_argument("--show", type=int, default=20, metavar="N",
                        help="missing/incorrect lines printed per case and mesh (default: 20; JSON has all)")
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
    from shardverify.audit.run import audit_spec

    if single := one_rank_mesh(args.mesh):
        print(f"error: {single}", file=sys.stderr)
        return USAGE
    try:
        specs = load_op_specs(args.root, args.specs_dir, args.specs)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    if not specs:
        print("error: no op specs to audit", file=sys.stderr)
        return USAGE
    start = time.perf_counter()
    rows: list = []
    try:
        for spec in specs:
            audit_spec(spec, args.mesh, partial_inputs=args.partial_inputs, on_result=rows.append)
    except KeyboardInterrupt:   # Ctrl-C: the cases audited so far, no traceback
        if rows and not args.json:
            print(format_table(rows))
        print(f"\nshardverify audit: interrupted after {len(rows)} case(s); exit 130", file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - start
    disagreements = []
    if args.dtensor:
        from shardverify.dtensor.propagation import compare_specs

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
        return 1 if failed else 0
    if args.markdown:
        from shardverify.audit.report import markdown_report
        from shardverify.dtensor.propagation_report import dtensor_markdown

        print(markdown_report(rows))
        if args.dtensor:
            print("DTensor comparison (fake process group, in-process):\n")
            print(dtensor_markdown(disagreements))
        return 1 if failed else 0
    print(format_table(rows))
    for line in _details(rows, args.show):
        print(line)
    if args.dtensor:
        from shardverify.dtensor.propagation import format_disagreements

        print("\n" + format_disagreements(disagreements))
    missing = sum(len(r.missing) for r in rows)
    incorrect = sum(len(r.incorrect) for r in rows)
    accepted = sum(len(r.accepted) for r in rows)
    verdict = "FAILED" if failed else "passed"
    print(f"\n{verdict}: {sum(r.combinations for r in rows)} combination(s), {decided} decided numerically "
          f"({per_combo_ms:.3f} ms each), {missing} missing, {accepted} accepted, {incorrect} incorrect, "
          f"{elapsed:.1f}s")
    if decided == 0:
        print("no combination was decided numerically: nothing was checked")
    return 1 if failed else 0
