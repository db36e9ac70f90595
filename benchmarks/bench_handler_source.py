"""Where the op handlers come from, priced: importing the committed generated handler modules
(``shardverify/strategies/handlers/generated/``, one per op spec) against registering handlers
straight from the parsed specs (every op spec read from specs/, each turned into the same
``HandlerDef``), measured in one process, each path from a clean registry, best of ``--repeat``:

1. generated: import every generated handler module (from its cached bytecode, as any process does);
2. from specs: discover and parse every op spec (the catalogue, ``shardverify.spec.catalogue``),
   build each spec's ``HandlerDef`` as the handler template writes it, register it;
3. of which the parse: the catalogue's discovery and parse alone.

Both paths must register the same handlers (equal ``HandlerDef``s, the same names): a difference
is an error (exit 1), so the comparison is of two ways to the same registry. It prints the
seconds of each and the ratio from specs / generated, and the lines each way keeps in the tree::

    .venv/bin/python benchmarks/bench_handler_source.py            # best of 3
    .venv/bin/python benchmarks/bench_handler_source.py --quick    # best of 1
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
import time
from pathlib import Path

import shardverify.strategies.handlers as handlers
from shardverify.spec.catalogue import load_op_specs
from shardverify.spec.fields import lookup
from shardverify.strategies.handlers import generated
from shardverify.strategies.handlers.base import HandlerDef, register_handler, registered_handlers, unregister_handler

ROOT = Path(__file__).resolve().parent.parent


def handler_of(spec) -> HandlerDef:
    """The HandlerDef of an op spec, field by field as templates/op_handler.py.j2 writes it."""
    return HandlerDef(
        name=spec.name, targets=tuple(lookup(t.name) for t in spec.targets), operands=spec.operands,
        params=spec.params, generator=spec.generator, rule=spec.rule, spec_file=spec.source,
        bindings=tuple((lookup(t.name), tuple(spec.bindings(t))) for t in spec.bound_targets()),
        ignores=tuple(spec.ignores),
        drawn=tuple((i.role, i.values, i.grad) for i in spec.verify.inputs if i.values is not None or not i.grad),
        dtypes=tuple((i.role, i.dtype) for i in spec.verify.inputs),
        overrides=tuple((lookup(t.name), t.operands, t.params) for t in spec.targets if t.aten),
        isolate=spec.verify.isolate)


def _clear() -> None:
    for name in registered_handlers():
        unregister_handler(name)
    for name in [m for m in sys.modules if m.startswith(generated.__name__ + ".")]:
        del sys.modules[name]


def from_generated() -> float:
    _clear()
    start = time.perf_counter()
    for info in sorted(pkgutil.iter_modules(generated.__path__), key=lambda i: i.name):
        importlib.import_module(f"{generated.__name__}.{info.name}")
    return time.perf_counter() - start


def from_specs() -> tuple[float, float]:
    _clear()
    start = time.perf_counter()
    specs = load_op_specs(ROOT, None, [])
    parsed = time.perf_counter()
    for spec in specs:
        register_handler(handler_of(spec))
    return time.perf_counter() - start, parsed - start


def _lines(paths) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the best of each is printed (default 3)")
    args = parser.parse_args(argv)
    if handlers.GENERATED_HANDLER_PROBLEMS:
        print(f"bench_handler_source: generated handlers not registered: {handlers.handler_problems()}", file=sys.stderr)
        return 1
    rounds = 1 if args.quick else max(1, args.repeat)
    generated_s, specs_s, parse_s = [], [], []
    for _ in range(rounds):
        generated_s.append(from_generated())
        wanted = registered_handlers()
        total, parse = from_specs()
        specs_s.append(total)
        parse_s.append(parse)
        built = registered_handlers()
        if built != wanted:
            differ = sorted(set(wanted) ^ set(built) | {n for n in set(wanted) & set(built) if wanted[n] != built[n]})
            print(f"bench_handler_source: the handlers built from the specs differ from the generated ones: "
                  f"{differ[:10]}", file=sys.stderr)
            return 1
    from_generated()   # leave the registry as a process finds it
    modules = sorted(Path(generated.__file__).parent.glob("*.py"))
    print(f"handlers: {len(wanted)} op specs")
    print(f"generated modules imported:     {min(generated_s):7.3f} s")
    print(f"registered from parsed specs:   {min(specs_s):7.3f} s  (parse {min(parse_s):.3f} s)")
    print(f"ratio from specs / generated:   {min(specs_s) / min(generated_s):7.1f}x")
    print(f"lines kept: generated handler modules {_lines(modules)} in {len(modules)} files (written by "
          f"`shardverify generate`); the template {_lines([ROOT / 'shardverify/codegen/templates/op_handler.py.j2'])}, "
          f"this builder {sum(len(inspect.getsource(f).splitlines()) for f in (handler_of,))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
