"""`shardverify dtensor`'s options and what they name: the arguments it takes, the values they
are checked to hold, and the specs and accepted file read before anything runs (a usage error is
one line and exit status 2, before any case). Apart from the command so its run reads as steps."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from shardverify.cli import parse_int, parse_seconds
from shardverify.cli.cluster_option import add_cluster_options
from shardverify.cli.dtensor_cluster import cluster_problem
from shardverify.cli.html_option import add_html_option, html_problem
from shardverify.cli.verify_cmd import parse_mesh
from shardverify.errors import SpecError

__all__ = ["ACCEPTED", "UPSTREAM", "Inputs", "add_arguments", "read_inputs", "run_problem", "command_line"]

ACCEPTED = Path("specs/dtensor/accepted.yaml")
UPSTREAM = Path("docs/upstream")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of `dtensor` (the parser itself and its help are the command's)."""
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


@dataclass
class Inputs:
    """What a run is given: the op specs, the custom-op specs, the accepted classes (None when no
    file), and the --limit and --budget in effect (None: no limit)."""

    specs: list
    customs: list
    accepted: object
    limit: int | None
    budget: float | None


def read_inputs(args: argparse.Namespace) -> Inputs | None:
    """The run's inputs, or None when the arguments are a usage error (said on stderr)."""
    from shardverify.cli.catalogue import load_op_specs
    from shardverify.features.dtensor.accepted import load_accepted
    from shardverify.features.dtensor.custom import load_custom
    from shardverify.features.dtensor.run import DEFAULT_BUDGET, DEFAULT_LIMIT

    problem = html_problem(args.html)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return None
    limit = DEFAULT_LIMIT if args.limit is None else (None if args.limit == 0 else args.limit)
    budget = DEFAULT_BUDGET if args.budget is None else (args.budget or None)
    try:
        specs = load_op_specs(args.root, args.specs_dir, args.specs) if args.specs or not args.custom else []
        customs = [load_custom(path) for path in args.custom]
        accepted_path = args.accepted or (args.root / ACCEPTED if (args.root / ACCEPTED).exists() else None)
        accepted = load_accepted(accepted_path) if accepted_path is not None else None
    except (SpecError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    folder = args.results if args.from_json is None else args.from_json if args.from_json.is_dir() else None
    if args.confirm and folder is None:    # a saved --json file holds no place to store them
        print("error: --confirm stores what it finds beside the results: give --results DIR or --from-json DIR",
              file=sys.stderr)
        return None
    return Inputs(specs, customs, accepted, limit, budget)


def run_problem(args: argparse.Namespace, inputs: Inputs) -> str:
    """Why the cases cannot be run as asked ("" when they can); checked after --from-json, which
    runs nothing."""
    if not inputs.specs and not inputs.customs:
        return "no op specs to run"
    return cluster_problem(args)


def _count(text: str) -> int:
    """--limit: a non-negative integer (0: all)."""
    return parse_int(text, 0, "expected a non-negative integer, got {text!r}")


def _seconds(text: str) -> float:
    """--budget: a finite number of seconds >= 0 (0: no limit); inf and nan are refused, a budget
    that stops nothing or everything would make a run that checks nothing look like a pass."""
    return parse_seconds(text, "expected a finite number of seconds >= 0 (0: no limit), got {text!r}", zero=True)


def command_line(args: argparse.Namespace) -> str:
    """The run's command: what was run, not where its output went."""
    words = ["shardverify dtensor", *args.specs]
    words += [f"--custom {path}" for path in args.custom]
    words += [f"--mesh {','.join(map(str, mesh))}" for mesh in args.mesh or ()]
    words += [f"--limit {args.limit}"] if args.limit is not None else []
    words += [f"--budget {args.budget:g}"] if args.budget is not None else []
    words += ["--sample-passes"] if args.sample_passes else []
    words += ["--confirm" + (" all" if args.confirm == "all" else "")] if args.confirm else []
    return " ".join(words)
