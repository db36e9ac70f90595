"""`shardverify list`: every spec with what it generates (ops: targets, generator, grid)."""

from __future__ import annotations

import argparse
import sys

from shardverify.cli.generate_cmd import add_location_options
from shardverify.codegen.generate import InvalidSpecs, discover_specs, load_kinds, load_specs
from shardverify.errors import SpecError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("list", help="list specs: ops, targets, generators, grid sizes",
                                   description="List every spec with its kind and summary.")
    add_location_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    specs_dir = args.specs_dir if args.specs_dir is not None else args.root / "specs"
    if not specs_dir.is_dir():
        print(f"error: no spec folder {specs_dir}; pass --specs-dir or --root", file=sys.stderr)
        return 1
    try:
        parsed = load_specs(discover_specs(specs_dir, args.root, load_kinds()))
    except InvalidSpecs as exc:
        for error in exc.errors:
            print(f"error: {error}", file=sys.stderr)
        return 1
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for source, spec in parsed:
        print(f"{source.kind.name} {spec.name}  ({source.display})")  # type: ignore[attr-defined]
        summary = source.kind.summary(spec) if source.kind.summary else {}
        for column, text in summary.items():
            print(f"    {column + ':':<11} {text}")
    if not parsed:
        print(f"no specs in {specs_dir}")
    return 0
