"""`shardverify` entry point: each subcommand module exposes `add_parser(subparsers)`,
which registers its parser and sets `func(args) -> int` as the handler."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from shardverify.backends.signals import exit_on_sigterm

# Subcommand modules, in the order `--help` lists them.
SUBCOMMANDS = ("verify", "generate", "list", "coverage", "explore", "audit", "dtensor", "calibrate", "plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardverify",
                                     description="Declarative, numerically verified sharding strategies.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"shardverify.cli.{name}_cmd")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from shardverify.backends.gc_policy import tune_for_checking

    tune_for_checking()   # this process exists to check: see gc_policy
    args = build_parser().parse_args(argv)
    from shardverify.errors import SpecError
    from shardverify.spec.limits import check_settings

    try:
        check_settings()   # a bad limit setting is one line naming it, before any spec is read
    except SpecError as exc:
        print(f"shardverify: error: {exc}", file=sys.stderr)
        return 2
    previous = exit_on_sigterm()   # a `kill` cleans up like Ctrl-C (backends/signals.py)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # `shardverify list | head`: the reader left; exit quietly like other Unix tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
