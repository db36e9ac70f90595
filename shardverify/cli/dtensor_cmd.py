"""`shardverify dtensor [SPEC ...]`: execute PyTorch DTensor on every input layout combination
of each op spec's cases, forward and backward, and say where it computes wrong values silently,
raises, or communicates where it need not.

Exit status 1 when a silent-corruption class is found that the accepted file (default
``specs/dtensor/accepted.yaml`` when it exists) does not list; 2 on a usage or input error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from shardverify.cli import USAGE
from shardverify.cli.verify_cmd import parse_mesh
from shardverify.errors import SpecError

ACCEPTED = Path("specs/dtensor/accepted.yaml")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dtensor", help="execute DTensor on every layout combination and classify what it computes",
        description="For every case of each op spec (and each custom-op spec given with --custom) on each "
                    "mesh, run torch.distributed.tensor in process (LocalTensorMode, fake process group) "
                    "on every input layout combination, forward and backward, and compare every rank's "
                    "values with the single-device reference. Exit status 1 when DTensor computes wrong "
                    "values silently in a class the accepted file does not list.")
    parser.add_argument("specs", nargs="*", metavar="SPEC",
                        help="op spec paths or names (default: every op spec; none with --custom only)")
    parser.add_argument("--custom", action="append", type=Path, default=[], metavar="FILE",
                        help="a custom-op spec (specs/dtensor/*.yaml format): the user's own op and DTensor rule")
    parser.add_argument("--mesh", action="append", type=parse_mesh, metavar="SHAPE", default=None,
                        help="mesh shape such as 2,2 or 4 (repeatable; default: the meshes each spec lists)")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="combinations executed per case and mesh, an evenly spaced sample beyond "
                             "(default: 600; 0: all)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="seconds DTensor may take on one combination before the case's rest is left out "
                             "(default: 20; 0: no limit)")
    parser.add_argument("--accepted", type=Path, default=None, metavar="FILE",
                        help=f"the accepted silent-corruption classes (default: {ACCEPTED} if it exists)")
    parser.add_argument("--write-accepted", type=Path, default=None, metavar="FILE",
                        help="write every silent-corruption class found to FILE (reasons to fill in)")
    parser.add_argument("--write", type=Path, default=None, metavar="FILE",
                        help="write the Markdown report (docs/dtensor.md) to FILE")
    parser.add_argument("--repros", type=Path, default=None, metavar="DIR",
                        help="write a standalone repro script per silent-corruption class into DIR")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of the report")
    parser.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                        help="report on the results a --json run saved instead of running again (with --write, "
                             "--accepted: the page and the verdict against another accepted file)")
    parser.add_argument("--quiet", action="store_true", help="no progress line per case on stderr")
    parser.add_argument("--show", type=int, default=5, metavar="N", help="classes shown in the summary (default 5)")
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root (default: .)")
    parser.add_argument("--specs-dir", type=Path, default=None, help="folder holding the specs (default: ROOT/specs)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from shardverify.codegen.generate import load_op_specs
    from shardverify.dtensor.accepted import load_accepted, render_accepted
    from shardverify.dtensor.custom import load_custom, run_custom
    from shardverify.dtensor.report import markdown, new_silent, summary
    from shardverify.dtensor.run import DEFAULT_BUDGET, DEFAULT_LIMIT, run_spec

    limit = DEFAULT_LIMIT if args.limit is None else (None if args.limit == 0 else args.limit)
    if limit is not None and limit < 0:
        print(f"error: --limit must be >= 0, got {args.limit}", file=sys.stderr)
        return USAGE
    budget = DEFAULT_BUDGET if args.budget is None else (args.budget or None)
    if budget is not None and budget < 0:
        print(f"error: --budget must be >= 0, got {args.budget}", file=sys.stderr)
        return USAGE
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
    if args.from_json is not None:
        return _report_saved(args, accepted)
    if not specs and not customs:
        print("error: no op specs to run", file=sys.stderr)
        return USAGE
    start = time.perf_counter()
    results: list = []
    command = _command_line(args)
    torch_version = torch.__version__

    def done(result) -> None:   # progress on stderr: a full run takes a while
        results.append(result)
        if not args.quiet:
            counts = ", ".join(f"{n} {k}" for k, n in sorted(result.counts.items()))
            print(f"[{time.perf_counter() - start:7.1f}s] {result.op} {result.case} on {list(result.mesh)}: "
                  f"{result.executed} executed in {result.seconds:.1f}s ({counts or result.note[:100]})",
                  file=sys.stderr, flush=True)

    try:
        for spec in specs:
            run_spec(spec, args.mesh, limit=limit, budget=budget, on_result=done)
        for custom in customs:
            run_custom(custom, args.mesh, limit=limit, budget=budget, on_result=done)
    except SpecError as exc:   # a custom spec's module cannot be imported
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        print(f"\nshardverify dtensor: interrupted after {len(results)} case(s); exit 130", file=sys.stderr)
        return 130
    fresh = new_silent(results, accepted)
    if args.repros is not None:
        _write_repros(args.repros, results)
    if args.write_accepted is not None:
        keys: dict[str, list[str]] = {}
        for f in new_silent(results, None):
            reason = (accepted.reason(f.key()) if accepted else None) or "TODO: why DTensor is wrong here"
            keys.setdefault(reason, []).append(f.key())
        args.write_accepted.parent.mkdir(parents=True, exist_ok=True)
        args.write_accepted.write_text(render_accepted(keys, torch.__version__))
    if args.write is not None:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(markdown(results, accepted, command, torch_version))
    if args.json:
        json.dump({"passed": not fresh, "seconds": round(time.perf_counter() - start, 3), "command": command,
                   "torch": torch.__version__,
                   "new_silent_classes": [f.key() for f in fresh],
                   "results": [r.to_json() for r in results]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 1 if fresh else 0
    print(summary(results, accepted, args.show))
    executed = sum(r.executed for r in results)
    silent = sum(r.counts.get("silent-wrong", 0) for r in results)
    verdict = "FAILED" if fresh else "passed"
    print(f"\n{verdict}: {executed} combination(s) executed on DTensor, {silent} silently wrong, "
          f"{len(fresh)} new silent-corruption class(es), {time.perf_counter() - start:.1f}s")
    return 1 if fresh else 0


def _report_saved(args: argparse.Namespace, accepted) -> int:
    """--from-json: the summary, page and verdict of a saved run."""
    from shardverify.dtensor.report import markdown, new_silent, summary
    from shardverify.dtensor.run import CaseResult

    try:
        saved = json.loads(args.from_json.read_text())
        results = [CaseResult.from_json(item) for item in saved["results"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"error: {args.from_json}: not a saved `shardverify dtensor --json` run ({exc})", file=sys.stderr)
        return USAGE
    if args.write is not None:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(markdown(results, accepted, saved.get("command", "shardverify dtensor"),
                                       saved.get("torch", "?")))
    fresh = new_silent(results, accepted)
    print(summary(results, accepted, args.show))
    print(f"\n{'FAILED' if fresh else 'passed'} (saved run {args.from_json}): {len(fresh)} new silent-corruption "
          "class(es)")
    return 1 if fresh else 0


def _command_line(args: argparse.Namespace) -> str:
    """The run's command: what was run, not where its output went."""
    words = ["shardverify dtensor", *args.specs]
    words += [f"--custom {path}" for path in args.custom]
    words += [f"--mesh {','.join(map(str, mesh))}" for mesh in args.mesh or ()]
    words += [f"--limit {args.limit}"] if args.limit is not None else []
    words += [f"--budget {args.budget:g}"] if args.budget is not None else []
    return " ".join(words)


def _write_repros(folder: Path, results) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for r in results:
        for f in r.findings:
            if f.repro:
                name = "".join(c if c.isalnum() else "_" for c in f.key()).strip("_")[:120]
                (folder / f"{name}.py").write_text(f.repro)
