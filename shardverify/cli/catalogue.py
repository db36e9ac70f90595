"""The CLI's spec catalogue: every spec kind registered (op, collective, model, reshard, plan,
in the order `list` and `generate` read them and errors list specs), the --root/--specs-dir
options, the located specs (all, or the op specs a command checks: `load_op_specs`, here with every
kind known, so naming a collective spec says so) and the generated handlers that did not register.

The kinds are registered here, where the commands are put together, rather than by their
modules on import: the order then does not depend on which command imported what first, and
`shardverify.spec` (floor 4) reads them without importing the features that define them."""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

from shardverify.errors import SpecError
from shardverify.spec.catalogue import InvalidSpecs, load_op_specs, load_specs, spec_sources
from shardverify.spec.kinds import SpecKind, register_spec_kind
from shardverify.spec.op_kind import HANDLER_DIR, OP_KIND

__all__ = ["KINDS", "add_location_options", "located_specs", "load_op_specs", "checked_op_specs", "broken_handlers"]


@dataclass(frozen=True)
class _Deferred:
    """A kind's function, imported from its feature's module at the first call: a command that
    reads op specs only (`verify mm`) never imports the plan, model, collective or reshard features."""

    module: str
    name: str

    def __call__(self, *args: object) -> object:
        return getattr(importlib.import_module(self.module), self.name)(*args)


def _feature_kind(name: str, subdir: str, module: str, noun: str) -> SpecKind:
    """The kind ``name`` whose specs live in ``subdir`` and whose parse, render and summary are
    ``parse_<noun>_spec`` ... in ``module``."""
    return SpecKind(name=name, subdir=subdir, parse=_Deferred(module, f"parse_{noun}_spec"),
                    render=_Deferred(module, f"render_{noun}_spec"), summary=_Deferred(module, f"summarize_{noun}_spec"))


#: every spec kind, in catalogue order (a new kind: its module, and one entry here)
KINDS: tuple[SpecKind, ...] = tuple(register_spec_kind(kind) for kind in (
    OP_KIND,
    _feature_kind("collective", "collectives", "shardverify.features.algorithms.spec", "collective"),
    _feature_kind("model", "models", "shardverify.features.ddp.spec", "model"),
    _feature_kind("reshard", "reshard", "shardverify.features.reshard.spec", "reshard"),
    _feature_kind("plan", "plans", "shardverify.plan.spec", "plan"),
))


def add_location_options(parser: argparse.ArgumentParser) -> None:
    """--root and --specs-dir, shared by the commands that read specs."""
    parser.add_argument("--root", type=Path, default=Path("."),
                        help="repository root that generated paths are relative to (default: .)")
    parser.add_argument("--specs-dir", type=Path, default=None,
                        help="folder holding the specs (default: ROOT/specs)")


def located_specs(args: argparse.Namespace) -> list | None:
    """Every spec under the --root/--specs-dir location, parsed; None, with each error printed,
    when any is invalid (shared by `shardverify list` and `coverage`)."""
    try:
        return load_specs(spec_sources(args.root, args.specs_dir))
    except InvalidSpecs as exc:
        for error in exc.errors:
            print(f"error: {error}", file=sys.stderr)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
    return None


def checked_op_specs(args: argparse.Namespace, verb: str) -> list | None:
    """The op specs a checking command named (every one when none is named); None, with the error
    printed, when one is invalid or there are none (shared by `verify` and `audit`)."""
    try:
        specs = load_op_specs(args.root, args.specs_dir, args.specs)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    if not specs:
        print(f"error: no op specs to {verb}", file=sys.stderr)
        return None
    return specs


def broken_handlers(root: Path) -> list[str]:
    """The generated handlers of this checkout that did not register when shardverify was
    imported (stale or conflicting files), when `root` is the checkout that was imported."""
    import shardverify.strategies.handlers as handlers

    package_dir = Path(handlers.__file__).resolve().parent / "generated"
    if (root / HANDLER_DIR).resolve() != package_dir:
        return []
    return handlers.handler_problems()
