"""`shardverify generate [SPEC ...] [--check]`: expand specs into handlers and tests."""

from __future__ import annotations

import argparse
import sys

from shardverify.cli import USAGE
from shardverify.cli.catalogue import add_location_options, broken_handlers
from shardverify.codegen.generate import generate
from shardverify.errors import SpecError
from shardverify.spec.catalogue import InvalidSpecs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate handlers and tests from specs",
        description="Expand YAML specs into handler modules and generated tests. Nothing is "
                    "written when any spec is invalid; unchanged files are not touched.")
    parser.add_argument("specs", nargs="*", metavar="SPEC",
                        help="spec paths or names (default: every spec; orphans are only "
                             "handled when no SPEC is given)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 and print a diff if any generated file is "
                             "stale, missing or an orphan")
    add_location_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        changes = generate(args.root, args.specs_dir, args.specs, check=args.check)
    except InvalidSpecs as exc:
        for error in exc.errors:
            print(f"error: {error}", file=sys.stderr)
        print(f"{len(exc.errors)} invalid spec(s); nothing was written", file=sys.stderr)
        return USAGE
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    except OSError as exc:
        print(f"error: cannot write the generated files: {exc}", file=sys.stderr)
        return 1
    problems = broken_handlers(args.root)
    if args.check:
        for change in changes:
            sys.stdout.write(change.diff())
        for change in changes:
            print(f"{change.status}: {change.path}", file=sys.stderr)
        for problem in problems:
            print(f"broken: {problem}", file=sys.stderr)
        if changes or problems:
            print("generated files are out of date; run `shardverify generate`", file=sys.stderr)
            return 1
        print("generated files are up to date", file=sys.stderr)
        return 0
    verbs = {"missing": "created", "stale": "updated", "orphan": "removed orphan"}
    for change in changes:
        print(f"{verbs[change.status]} {change.path}")
    for problem in problems:   # as found when this process imported shardverify
        print(f"note: at start-up {problem}; `shardverify generate --check` confirms the repair",
              file=sys.stderr)
    if not changes:
        print("generated files are up to date")
    return 0
