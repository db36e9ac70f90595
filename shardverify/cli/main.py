"""`shardverify` entry point: each subcommand module exposes `add_parser(subparsers)`,
which registers its parser and sets `func(args) -> int` as the handler."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from shardverify import stops
from shardverify.backends.signals import exit_on_sigterm, keep_interrupts

# Subcommand modules, in the order `--help` lists them.
SUBCOMMANDS = ("verify", "generate", "list", "coverage", "explore", "audit", "dtensor", "calibrate", "plan",
               "parallelize")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; of only the one ``argv`` starts with, when it names one
    (importing the others' modules is a tenth of a short command's start). ``--help`` and an
    unknown command get them all."""
    parser = argparse.ArgumentParser(prog="shardverify",
                                     description="Declarative, numerically verified sharding strategies.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in argv[:1] if argv and argv[0] in SUBCOMMANDS else SUBCOMMANDS:
        module = importlib.import_module(f"shardverify.cli.{name}_cmd")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from shardverify.backends.gc_policy import tune_for_checking

    if getattr(signal.getsignal(signal.SIGINT), "__name__", "") == "starting":   # shardverify/__init__.py's
        signal.signal(signal.SIGINT, signal.default_int_handler)
    tune_for_checking()   # this process exists to check: see gc_policy
    try:
        argv = sys.argv[1:] if argv is None else argv
        args = build_parser(argv).parse_args(argv)   # imports the subcommand: a Ctrl-C may come here
    except KeyboardInterrupt:
        print("shardverify: interrupted; exit 130", file=sys.stderr)
        return 130
    from shardverify.errors import SpecError
    from shardverify.spec.limits import check_settings
    from shardverify.spec.trust import check_trusted_setting

    try:
        check_settings()   # a bad limit setting is one line naming it, before any spec is read
        check_trusted_setting()   # alike a bad trusted-targets setting
    except SpecError as exc:
        print(f"shardverify: error: {exc}", file=sys.stderr)
        return 2
    previous = exit_on_sigterm()   # a `kill` cleans up like Ctrl-C (backends/signals.py)
    hook = keep_interrupts()   # ... and neither is lost in a finalizer
    try:
        stops.raise_if_stopped()   # a stop while torch was imported whose exception the import lost
        return int(args.func(args) or 0)
    except KeyboardInterrupt:   # outside a subcommand's own handler (its imports, reading specs)
        print(f"shardverify {args.command}: interrupted; exit 130", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `shardverify list | head`: the reader left; exit quietly like other Unix tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    finally:
        stops.clear()   # the stop was this command's: a next one in this process starts clean
        sys.unraisablehook = hook
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
