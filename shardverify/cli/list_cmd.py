"""`shardverify list`: every spec with what it generates (ops: targets, generator, grid).

Listing reads the specs and runs nothing they name (no op, no model factory): which cases have
only the replicated strategy is said by `shardverify verify`, which runs them."""

from __future__ import annotations

import argparse
import sys

from shardverify.cli import USAGE
from shardverify.cli.catalogue import add_location_options, broken_handlers, located_specs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("list", help="list specs: ops, targets, generators, grid sizes",
                                   description="List every spec with its kind and summary. Nothing a spec "
                                               "names is run: `shardverify verify` warns about op cases "
                                               "that only the replicated strategy covers on a mesh.")
    add_location_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    parsed = located_specs(args)
    if parsed is None:
        return USAGE
    for source, spec in parsed:
        print(f"{source.kind.name} {spec.name}  ({source.display})")  # type: ignore[attr-defined]
        summary = source.kind.summary(spec) if source.kind.summary else {}
        for column, text in summary.items():
            print(f"    {column + ':':<11} {text}")
    for problem in broken_handlers(args.root):
        print(f"warning: {problem}; run `shardverify generate`", file=sys.stderr)
    return 0
