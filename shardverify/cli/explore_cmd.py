"""`shardverify explore SPEC`: search shapes, parameters and meshes beyond the spec's grid.

The same search as the generated property tests (shardverify.features.explore), on the simulated
backend. On failure it prints the shrunk case, the report and a reproduction; exit 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from shardverify.cli import USAGE, parse_int
from shardverify.errors import InvalidArgument, SpecError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from shardverify.features.explore import DEFAULT_MESH_MAX_SIZE, MAX_MESH_SIZE

    parser = subparsers.add_parser(
        "explore", help="search cases beyond an op spec's grid with hypothesis",
        description="Draw input shapes, parameters and mesh shapes from an op spec, verify every "
                    "strategy of each drawn case on the simulated backend, and shrink any failure to "
                    "a minimal case printed with a reproduction. Exit status 1 on failure.")
    parser.add_argument("spec", metavar="SPEC", help="op spec path or name, e.g. sum or specs/sum.yaml")
    parser.add_argument("--examples", type=_positive("--examples"), default=50, metavar="N",
                        help="number of drawn cases (default: 50)")
    parser.add_argument("--mesh-max-size", type=_positive("--mesh-max-size", MAX_MESH_SIZE),
                        default=DEFAULT_MESH_MAX_SIZE, metavar="N",
                        help=f"most devices a drawn mesh may have, at most {MAX_MESH_SIZE} "
                             f"(default: {DEFAULT_MESH_MAX_SIZE})")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="random seed (default: derandomized, the same cases every run)")
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root (default: .)")
    parser.add_argument("--specs-dir", type=Path, default=None,
                        help="folder holding the specs (default: ROOT/specs)")
    parser.set_defaults(func=run)


def _positive(option: str, most: int | None = None):
    bound = f" from 1 to {most}" if most is not None else " >= 1"

    def parse(text: str) -> int:
        return parse_int(text, 1, f"{option} {{text!r}} is not an integer{bound}", most)
    return parse


def run(args: argparse.Namespace) -> int:
    from shardverify.cli.catalogue import load_op_specs
    from shardverify.features.explore import search

    try:
        (spec,) = load_op_specs(args.root, args.specs_dir, [args.spec])
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    if not spec.verify.explore:
        print(f"error: {spec.source} says `explore: false` (its comment says why); the explorer would draw cases "
              "its author ruled out. Remove the line to explore it anyway.", file=sys.stderr)
        return USAGE
    drawn = [0]

    def count(_example) -> None:
        drawn[0] += 1

    start = time.perf_counter()
    try:
        failure = search(spec, examples_count=args.examples, mesh_max_size=args.mesh_max_size,
                         seed=args.seed, on_example=count)
    except InvalidArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    elapsed = time.perf_counter() - start
    if failure is None and drawn[0] == 0:   # no pass without a check
        print(f"FAILED: {spec.name}: no case was drawn and verified ({elapsed:.1f}s)")
        return 1
    if failure is None:
        print(f"passed: {spec.name}: {drawn[0]} drawn case(s) on meshes of up to {args.mesh_max_size} "
              f"device(s), every strategy verified ({elapsed:.1f}s)")
        return 0
    print(f"FAILED: {spec.name}: shrunk failing case after {drawn[0]} run(s) ({elapsed:.1f}s):\n"
          f"  {failure.example.describe()}\n\n{failure.error}\n\n{failure.reproduction}")
    return 1
