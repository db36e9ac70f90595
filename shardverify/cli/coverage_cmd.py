"""`shardverify coverage --core-aten`: every Core ATen overload of the pinned torch with the spec
that serves it, the stated reason no layout of it can be verified, or "no spec yet"; then the
totals. The catalogue is shardverify/features/coverage/core_aten.py; this module only prints it."""

from __future__ import annotations

import argparse
import json
import sys

from shardverify.cli import USAGE
from shardverify.cli.catalogue import add_location_options, located_specs
from shardverify.features.coverage.core_aten import NO_SPEC, REASON, REASONS_FILE, SERVED, Catalogue, catalogue
from shardverify.errors import SpecError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "coverage", help="which ops of an op set the specs serve",
        description="List every Core ATen overload of the installed torch (tagged torch.Tag.core), "
                    "grouped by op packet, with the spec serving it, the reason no layout of it can "
                    f"be verified (SPECS/{REASONS_FILE}), or 'no spec yet'; then the totals.")
    parser.add_argument("--core-aten", action="store_true", required=True,
                        help="the Core ATen op set (the one torch.export decomposes into)")
    parser.add_argument("--json", action="store_true", help="print a machine-readable report")
    add_location_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    specs_dir = args.specs_dir if args.specs_dir is not None else args.root / "specs"
    parsed = located_specs(args)
    if parsed is None:
        return USAGE
    pairs = [(source.display, tuple(t.name for t in spec.targets))
             for source, spec in parsed if source.kind.name == "op"]
    try:
        result = catalogue(pairs, specs_dir / REASONS_FILE)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
    else:
        _print(result)
    return 0


def _print(result: Catalogue) -> None:
    print(f"Core ATen overloads of torch {result.torch_version}, by packet:")
    for packet in result.packets:
        print(f"{packet.name}  [{packet.status}]")
        for overload in packet.overloads:
            detail = (", ".join(overload.specs) if overload.status == SERVED
                      else overload.reason if overload.status == REASON else NO_SPEC)
            print(f"    {overload.name:<44} {detail}")
    total = len(result.packets)
    overloads = sum(len(p.overloads) for p in result.packets)
    print(f"\n{total} packets ({overloads} overloads): "
          f"{result.count(SERVED)} served by a spec ({result.count(SERVED, packets=False)} overloads), "
          f"{result.count(REASON)} unverifiable with a stated reason "
          f"({result.count(REASON, packets=False)} overloads), "
          f"{result.count(NO_SPEC)} with no spec yet ({result.count(NO_SPEC, packets=False)} overloads; "
          f"{result.partly_served} of these packets partly served); "
          f"{total - result.count(NO_SPEC)} of {total} accounted for")
