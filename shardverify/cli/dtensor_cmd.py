"""`shardverify dtensor [SPEC ...]`: execute PyTorch DTensor on every input layout combination
of each op spec's cases, forward and backward, and say where it computes wrong values silently,
raises, or communicates where it need not.

Exit status 1 when a silent-corruption or late-failure class is found that the accepted file (default
``specs/dtensor/accepted.yaml`` when it exists) does not list; 2 on a usage or input error.

The report starts with the verdict (PASS or FAIL, the counts, the first new class), then the
classes found; -v adds the per-case table and notes (and a line per case on stderr as it ends).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from shardverify.cli import USAGE
from shardverify.cli.cluster_option import add_cluster_options
from shardverify.cli.dtensor_cluster import cluster_problem, sweep_on_cluster
from shardverify.cli.html_option import add_html_option, html_problem
from shardverify.cli.progress import Progress
from shardverify.cli.row_warnings import Caught, caught_warnings
from shardverify.cli.verdict import count, verdict_line, warnings_detail, warnings_note
from shardverify.cli.verify_cmd import parse_mesh
from shardverify.errors import ShardVerifyError, SpecError
from shardverify.files import write_file_atomic

ACCEPTED = Path("specs/dtensor/accepted.yaml")
UPSTREAM = Path("docs/upstream")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dtensor", help="execute DTensor on every layout combination and classify what it computes",
        description="For every case of each op spec (and each custom-op spec given with --custom) on each "
                    "mesh, run torch.distributed.tensor in process (LocalTensorMode, fake process group) "
                    "on every input layout combination, forward and backward, and compare every rank's "
                    "values with the single-device reference. Exit status 1 when DTensor computes wrong "
                    "values silently, or returns and fails later, in a class the accepted file does not list.")
    parser.add_argument("specs", nargs="*", metavar="SPEC",
                        help="op spec paths or names (default: every op spec; none with --custom only)")
    parser.add_argument("--custom", action="append", type=Path, default=[], metavar="FILE",
                        help="a custom-op spec (specs/dtensor/*.yaml format): the user's own op and DTensor rule")
    parser.add_argument("--mesh", action="append", type=parse_mesh, metavar="SHAPE", default=None,
                        help="mesh shape such as 2,2 or 4 (repeatable; default: the meshes each spec lists)")
    parser.add_argument("--limit", type=_count, default=None, metavar="N",
                        help="combinations executed per case and mesh, an evenly spaced sample beyond "
                             "(default: 600; 0: all)")
    parser.add_argument("--budget", type=_seconds, default=None, metavar="SECONDS",
                        help="CPU seconds DTensor may take on one combination before the case's rest is left out "
                             "(default: 20; 0: no limit); a run it cut short is no pass (see --sample-passes)")
    parser.add_argument("--sample-passes", action="store_true",
                        help="pass a run whose --budget left combinations unchecked on the combinations it did "
                             "check (the skipped ones are still counted and said)")
    parser.add_argument("--accepted", type=Path, default=None, metavar="FILE",
                        help=f"the accepted silent-corruption and late-failure classes (default: {ACCEPTED} if it exists)")
    parser.add_argument("--write-accepted", type=Path, default=None, metavar="FILE",
                        help="write every silent-corruption and late-failure class found to FILE (reasons to fill in)")
    parser.add_argument("--write", type=Path, default=None, metavar="FILE",
                        help="write the Markdown report (docs/dtensor.md) to FILE")
    parser.add_argument("--repros", type=Path, default=None, metavar="DIR",
                        help="write a standalone repro script per silent-corruption or late-failure class into DIR")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of the report")
    add_html_option(parser, "the outcomes by case and mesh and each class of wrong results with its repro")
    parser.add_argument("--results", type=Path, default=None, metavar="DIR",
                        help="store every case's result in DIR (one file per spec, mesh, torch version and limit) "
                             "and continue from what it holds: an interrupted run resumes where it stopped")
    add_cluster_options(parser, "cases (this process storing every result, --results, as a run here does; op "
                                "specs only)")
    parser.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                        help="report on the results a --json run saved (a file) or a --results folder holds (a "
                             "folder: the SPECs, --mesh and --limit chosen, saying how much is complete) instead "
                             "of running again (with --write, --accepted: the page and the verdict)")
    parser.add_argument("--confirm", nargs="?", const="silent", choices=("silent", "all"), default=None,
                        help="run each silent-corruption class's repro (all: and each late failure's) under torchrun "
                             "on real gloo processes, one per rank, and say per class whether it reproduced; stored "
                             "in the results folder (--results or --from-json DIR), run again only when the "
                             "class's example changed. Exit 1 when a class does not reproduce")
    parser.add_argument("--confirm-timeout", type=_seconds, default=None, metavar="SECONDS",
                        help="seconds one class's torchrun may take before all its processes are killed "
                             "(default 300; 0: no limit)")
    parser.add_argument("--upstream", nargs="?", type=Path, const=UPSTREAM, default=None, metavar="DIR",
                        help=f"re-run every upstream bug report's repro (default folder: {UPSTREAM}) on the installed "
                             "torch and say which are fixed (exit 1 when a repro neither reproduces nor passes)")
    parser.add_argument("--gate", action="store_true",
                        help="also fail when every class of an accepted root cause on the ops run is gone (fixed "
                             "upstream: retire its entry) or when a root cause's repro (its 'repros') exits 0 "
                             "(stops reproducing), is missing or errs; run the ops over every mesh their classes "
                             "live on")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="after the verdict and the classes, one row per case and mesh and each case's note; "
                             "a line per case on stderr as it ends")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress on stderr (the line a terminal shows, or -v's line per case)")
    parser.add_argument("--show", type=int, default=5, metavar="N", help="classes shown in the summary (default 5)")
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root (default: .)")
    parser.add_argument("--specs-dir", type=Path, default=None, help="folder holding the specs (default: ROOT/specs)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from shardverify.cli.catalogue import load_op_specs
    from shardverify.dtensor.accepted import load_accepted
    from shardverify.dtensor.custom import load_custom, run_custom
    from shardverify.dtensor.report import markdown, new_classes
    from shardverify.dtensor.run import DEFAULT_BUDGET, DEFAULT_LIMIT, run_spec
    from shardverify.dtensor.store import HARNESS

    if args.upstream is not None:
        return _upstream(args)
    problem = html_problem(args.html)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return USAGE
    limit = DEFAULT_LIMIT if args.limit is None else (None if args.limit == 0 else args.limit)
    budget = DEFAULT_BUDGET if args.budget is None else (args.budget or None)
    try:
        specs = load_op_specs(args.root, args.specs_dir, args.specs) if args.specs or not args.custom else []
        customs = [load_custom(path) for path in args.custom]
        accepted_path = args.accepted or (args.root / ACCEPTED if (args.root / ACCEPTED).exists() else None)
        accepted = load_accepted(accepted_path) if accepted_path is not None else None
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    folder = args.results if args.from_json is None else args.from_json if args.from_json.is_dir() else None
    if args.confirm and folder is None:    # a saved --json file holds no place to store them
        print("error: --confirm stores what it finds beside the results: give --results DIR or --from-json DIR",
              file=sys.stderr)
        return USAGE
    if args.from_json is not None and args.from_json.is_dir():
        return _report_stored(args, accepted, specs, limit)
    if args.from_json is not None:
        return _report_saved(args, accepted)
    if not specs and not customs:
        print("error: no op specs to run", file=sys.stderr)
        return USAGE
    if problem := cluster_problem(args):
        print(f"error: {problem}", file=sys.stderr)
        return USAGE
    start = time.perf_counter()
    results: list = []
    command = _command_line(args)
    torch_version = torch.__version__

    progress = Progress(0 if args.quiet or args.verbose or args.json else
                        sum(len(spec.cases()) * len(args.mesh or spec.verify.meshes) for spec in specs)
                        + sum(len(custom.cases) * len(args.mesh or custom.meshes) for custom in customs))

    caught = Caught()   # the warnings torch gives on the ops' edge cases: counted, not printed (row_warnings)

    def done(result) -> None:   # progress on stderr: a full run takes a while
        progress.step()
        settled(result)

    def settled(result) -> None:
        results.append(result)
        with caught.outside():
            _said(result)

    def _said(result) -> None:
        progress.show(f"{result.op} {result.case} on {list(result.mesh)}")
        if args.quiet or not args.verbose:
            return
        if result.resumed:
            print(f"[{time.perf_counter() - start:7.1f}s] {result.op} {result.case} on {list(result.mesh)}: "
                  f"stored in {args.results} ({result.executed} executed)", file=sys.stderr, flush=True)
        else:
            counts = ", ".join(f"{n} {k}" for k, n in sorted(result.counts.items()))
            print(f"[{time.perf_counter() - start:7.1f}s] {result.op} {result.case} on {list(result.mesh)}: "
                  f"{result.executed} executed in {result.seconds:.1f}s ({counts or result.note[:100]})",
                  file=sys.stderr, flush=True)

    try:
        with progress, caught_warnings() as caught:
            if args.cluster is not None:
                sweep_on_cluster(args, specs, limit, budget, progress, caught, settled)
            else:
                for spec in specs:
                    run_spec(spec, args.mesh, limit=limit, budget=budget, on_result=done, store=args.results,
                             root=args.root)
            for custom in customs:
                run_custom(custom, args.mesh, limit=limit, budget=budget, on_result=done)
    except ShardVerifyError as exc:   # a custom spec's module cannot be imported; no cluster to join
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        print(f"\nshardverify dtensor: interrupted after {len(results)} case(s); exit 130", file=sys.stderr)
        return 130
    fresh = new_classes(results, accepted)
    executed = sum(r.executed for r in results)
    unchecked = _unchecked(results)
    cut, skipped = _budget_cut(results)
    confirmations = _confirmations(args, results, specs, args.results)
    gated = _gate(args, results, accepted)
    passed = (not fresh and not unchecked and not _unreproduced(confirmations) and (not cut or args.sample_passes)
              and len(gated or [""]) == 1)
    # The results reach stdout first: a file that cannot be written below loses none of them.
    if args.json:
        json.dump({"passed": passed, "seconds": round(time.perf_counter() - start, 3), "command": command,
                   "torch": torch.__version__, "harness": HARNESS, "executed": executed, "unchecked": unchecked,
                   "skipped_by_budget": skipped,
                   "new_classes": [f.key() for f in fresh],
                   "gloo": None if confirmations is None else {k: c.to_json() for k, c in confirmations.items()},
                   "results": [r.to_json() for r in results]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print("\n".join(_report(args, results, accepted, confirmations, passed, f"{time.perf_counter() - start:.1f}s",
                                warned=caught.counts, gated=gated)))
    sys.stdout.flush()

    outputs = [(args.repros, lambda folder: _write_repros(folder, results)),
               (args.write_accepted, _accepted_writer(results, accepted, torch.__version__)),
               (args.write, lambda path: _write_file(path, markdown(results, accepted, command, torch_version,
                                                                    confirmations=confirmations))),
               (args.html, _page_writer(results, accepted, passed, time.perf_counter() - start, command))]
    failed = _write_outputs(outputs)
    if failed:
        return USAGE
    return 0 if passed else 1


def _gate(args: argparse.Namespace, results, accepted) -> list[str] | None:
    """--gate: what fails it (root causes gone, repros that do not reproduce), one line each,
    then one line saying what it watched; None without --gate. Each repro's line goes to stderr
    as it ends unless --quiet."""
    if not args.gate:
        return None
    from shardverify.dtensor.accepted import Accepted
    from shardverify.dtensor.gate import gate_problems, run_repros

    accepted = accepted or Accepted({})
    repros = run_repros(accepted, args.root)
    if not args.quiet:
        for found in repros:
            print(f"repro {found.line()} ({found.seconds:.1f}s)", file=sys.stderr, flush=True)
    ops = {r.op for r in results if r.executed}
    watched = sum(any(key.split(" ", 1)[0] in ops for key in cause.keys) for cause in accepted.causes)
    return [f"gate: {line}" for line in gate_problems(results, accepted, repros)] + [
        f"gate: {watched} root cause(s) watched on the ops run; {sum(not r.failed for r in repros)} of "
        f"{len(repros)} repro(s) reproduce ({sum(r.seconds for r in repros):.1f}s)"]


def _report(args: argparse.Namespace, results, accepted, confirmations, passed: bool, source: str,
            about: str = "", warned: dict[str, int] | None = None, gated: list[str] | None = None) -> list[str]:
    """The report, verdict first: PASS or FAIL with the counts (``source``: the time a run took,
    or where its results were read), the first new class, what was not checked and why, ``about``
    the results, the classes found (at most --show of each kind), one line for the cases' notes and
    one for the warnings torch gave (``warned``); -v adds the per-case table, the notes and the
    warnings."""
    from shardverify.dtensor.report import case_notes, case_table, class_lines, new_class_name, new_classes
    from shardverify.dtensor.rootcause import severity_of

    fresh = new_classes(results, accepted)
    unchecked = _unchecked(results)
    cut, skipped = _budget_cut(results)
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


def _unchecked(results) -> list[str]:
    """Why the run checked nothing, when it did not: a run without one executed combination is
    never a pass (the cases' notes say what stopped each)."""
    if any(r.executed for r in results):
        return []
    if not results:
        return ["no case was run"]
    return [f"{r.op} {r.case} on {list(r.mesh)}: {r.note or 'no combination executed'}"[:300] for r in results]


def _budget_cut(results) -> tuple[list[str], int]:
    """The cases the time budget cut short, one line each, and how many combinations it left
    unchecked in all (a sample the budget chose is no pass unless --sample-passes says so)."""
    from shardverify.dtensor.run import budget_skipped

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


def _write_file(path: Path, text: str) -> None:
    write_file_atomic(path, text)     # whole or not at all: a full disk leaves no half page


def _accepted_writer(results, accepted, torch_version: str):
    """--write-accepted: every silent-corruption and late-failure class found, as root causes in
    the accepted file's format (shardverify.dtensor.rootcause.found_causes)."""
    def write(path: Path) -> None:
        from shardverify.dtensor.accepted import render_accepted
        from shardverify.dtensor.rootcause import found_causes

        _write_file(path, render_accepted(found_causes(results, accepted), torch_version))
    return write


def _page_writer(results, accepted, passed: bool, seconds: float, command: str):
    """What writes the run's HTML page to a path (--html)."""
    def write_page(path: Path) -> None:
        from shardverify.dtensor.accepted import Accepted
        from shardverify.report.dtensor_page import dtensor_page
        from shardverify.report.page import write

        write(dtensor_page(results, accepted or Accepted({}), passed, seconds, command), str(path))
        print(f"report: {path}", file=sys.stderr)

    return write_page


def _write_outputs(outputs) -> bool:
    """Each requested output written; one that fails is one line naming the file (the results are
    already on stdout). True when any failed."""
    failed = False
    for path, write in outputs:
        if path is None:
            continue
        try:
            write(path)
        except OSError as exc:
            print(f"error: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
            failed = True
    return failed


def _count(text: str) -> int:
    """--limit: a non-negative integer (0: all)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _seconds(text: str) -> float:
    """--budget: a finite number of seconds >= 0 (0: no limit); inf and nan are refused, a budget
    that stops nothing or everything would make a run that checks nothing look like a pass."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0 (0: no limit), got {text!r}")
    return value


def _report_saved(args: argparse.Namespace, accepted) -> int:
    """--from-json: the summary, page and verdict of a saved run."""
    from shardverify.dtensor.report import markdown, new_classes
    from shardverify.dtensor.run import CaseResult

    from shardverify.dtensor.store import made_by, read_saved_run

    try:
        saved = read_saved_run(args.from_json)
        results = [CaseResult.from_json(item) for item in saved["results"]]
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    fresh = new_classes(results, accepted)
    unchecked = _unchecked(results)
    cut, _ = _budget_cut(results)
    passed = not fresh and not unchecked and (not cut or args.sample_passes)
    print("\n".join(_report(args, results, accepted, None, passed, f"saved run {args.from_json}",
                            f"saved run {args.from_json}: {made_by(saved.get('torch'), saved.get('harness'))}")))
    sys.stdout.flush()
    if _write_outputs([(args.write, lambda path: _write_file(path, markdown(
            results, accepted, saved.get("command", "shardverify dtensor"), saved.get("torch", "?"),
            note=str(saved.get("note") or "")))),
            (args.write_accepted, _accepted_writer(results, accepted, saved.get("torch", "?"))),
            (args.html, _page_writer(results, accepted, passed, 0.0, saved.get("command", "shardverify dtensor")))]):
        return USAGE
    return 0 if passed else 1


def _report_stored(args: argparse.Namespace, accepted, specs, limit) -> int:
    """--from-json DIR: the summary, page and verdict of what a --results folder holds."""
    import torch

    from shardverify.dtensor.report import markdown, new_classes
    from shardverify.dtensor.run import stored_results

    try:
        results, note = stored_results(args.from_json, specs, args.mesh, limit, args.root)
    except (SpecError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    fresh = new_classes(results, accepted)
    unchecked = _unchecked(results)
    cut, _ = _budget_cut(results)
    confirmations = _confirmations(args, results, specs, args.from_json)
    gated = _gate(args, results, accepted)
    passed = (not fresh and not unchecked and not _unreproduced(confirmations) and (not cut or args.sample_passes)
              and len(gated or [""]) == 1)
    print("\n".join(_report(args, results, accepted, confirmations, passed, f"what {args.from_json} holds",
                            note, gated=gated)))
    sys.stdout.flush()
    command = _command_line(args) + f" --results {args.from_json}"
    if _write_outputs([(args.write, lambda path: _write_file(path, markdown(
            results, accepted, command, torch.__version__, note=note, confirmations=confirmations))),
            (args.write_accepted, _accepted_writer(results, accepted, torch.__version__)),
            (args.html, _page_writer(results, accepted, passed, 0.0, command))]):
        return USAGE
    return 0 if passed else 1


def _confirmations(args: argparse.Namespace, results, specs, folder: Path | None):
    """Each gated class's run on real gloo processes: run now (--confirm; what is stored for the
    same example is kept), or what ``folder`` holds; None without a results folder."""
    import torch

    from shardverify.dtensor.confirm import DEFAULT_TIMEOUT, class_examples, confirm_classes, load_confirmations

    if folder is None:
        return None
    if not args.confirm:
        examples = class_examples(results, specs, args.root)
        return load_confirmations(folder, torch.__version__, {k: e for k, (_, e) in examples.items()})
    klasses = ("silent-wrong",) if args.confirm == "silent" else ("silent-wrong", "late-failure")
    start = time.perf_counter()

    def said(found, reused: bool) -> None:
        if not args.quiet:
            how = "stored" if reused else f"{found.seconds:.0f}s on {found.world} gloo processes"
            print(f"[{time.perf_counter() - start:7.1f}s] gloo: {found.key}: {found.status} ({how}): "
                  f"{found.detail[:160]}", file=sys.stderr, flush=True)

    return confirm_classes(results, specs, folder, root=args.root, klasses=klasses, progress=said,
                           timeout=DEFAULT_TIMEOUT if args.confirm_timeout is None else args.confirm_timeout or None)


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


def _command_line(args: argparse.Namespace) -> str:
    """The run's command: what was run, not where its output went."""
    words = ["shardverify dtensor", *args.specs]
    words += [f"--custom {path}" for path in args.custom]
    words += [f"--mesh {','.join(map(str, mesh))}" for mesh in args.mesh or ()]
    words += [f"--limit {args.limit}"] if args.limit is not None else []
    words += [f"--budget {args.budget:g}"] if args.budget is not None else []
    words += ["--sample-passes"] if args.sample_passes else []
    words += ["--confirm" + (" all" if args.confirm == "all" else "")] if args.confirm else []
    return " ".join(words)


def _write_repros(folder: Path, results) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for r in results:
        for f in r.findings:
            if f.repro:
                name = "".join(c if c.isalnum() else "_" for c in f.key()).strip("_")[:120]
                write_file_atomic(folder / f"{name}.py", f.repro)


def _upstream(args: argparse.Namespace) -> int:
    """--upstream: each report's repro run here; which still reproduce on this torch, which are fixed."""
    import torch

    from shardverify.dtensor.upstream import load_reports, rerun

    folder = args.upstream if args.upstream.is_absolute() or args.upstream != UPSTREAM else args.root / UPSTREAM
    try:
        reports = load_reports(folder)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    counts: dict[str, int] = {}
    from shardverify.dtensor.execute import quiet_dtensor

    for report in reports:
        with quiet_dtensor():
            found = rerun(report)
        counts[found.status] = counts.get(found.status, 0) + 1
        word = {"still wrong": "still wrong", "fixed": "FIXED", "error": "ERROR"}[found.status]
        print(f"{word:11}  {report.name}: {report.title}")
        if found.status != "still wrong" and found.output:
            print("             " + found.output.splitlines()[-1])
    print(f"\ntorch {torch.__version__}: {len(reports)} upstream report(s), "
          + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    return 1 if counts.get("error") else 0
