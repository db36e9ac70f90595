"""How fast does the audit decide a layout combination, against DTensor's validator?

Runs, in this one process run:
  * DTensor's own validator (``python -m torch.distributed.tensor._ops.strategy_validation
    --op sum,mm,softmax --world-size 4 --device cpu``, needs the ``expecttest`` package: the
    ``bench`` extra), and reads how many combinations it decided and in how long;
  * the audit's numerical decision (shardverify.features.audit.decide) on sum, mm and softmax cases over
    every layout combination, partial inputs included, on the meshes (4,), (2, 2) and (2, 2, 2),
    without the symmetry shortcut (every combination really decided);
and prints ms per combination for each and their ratio.

Usage: .venv/bin/python benchmarks/bench_audit.py [--meshes 4 2,2 2,2,2] [--no-dtensor]
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
import time

from shardverify.features.audit.decide import Operand, prepare
from shardverify.features.audit.layouts import tensor_layouts
from shardverify.cli.verify_cmd import parse_mesh
from shardverify.sharding.mesh import DeviceMesh
from shardverify.spec.case import InputDecl, OpCase

CASES = {
    "sum": (OpCase(op="sum", target="torch.sum", inputs=(InputDecl("x", (8, 12)),), params=(("dim", 1),)),
            [("x", (8, 12))]),
    "mm": (OpCase(op="mm", target="torch.mm", inputs=(InputDecl("a", (8, 12)), InputDecl("b", (12, 16)))),
           [("a", (8, 12)), ("b", (12, 16))]),
    "softmax": (OpCase(op="softmax", target="torch.softmax", inputs=(InputDecl("x", (8, 12)),),
                       params=(("dim", -1),)), [("x", (8, 12))]),
}


def audit_rate(mesh_shape: tuple[int, ...]) -> tuple[int, float]:
    """(combinations decided, seconds) over every combination of the three ops on one mesh."""
    decided, seconds = 0, 0.0
    for case, shapes in CASES.values():
        operands = [Operand(name, name, ("arg", i), shape, True) for i, (name, shape) in enumerate(shapes)]
        problem = prepare(case, DeviceMesh(mesh_shape), operands)
        choices = [tensor_layouts(o.shape, mesh_shape) for o in operands]
        start = time.perf_counter()
        for combo in itertools.product(*choices):
            problem.decide(combo)
        seconds += time.perf_counter() - start
        decided += problem.decided
    return decided, seconds


def dtensor_rate(ops: str = "sum,mm,softmax", max_samples: int | None = None) -> tuple[int, float] | str:
    """(combinations, seconds) DTensor's validator reports on ``ops`` (its first ``max_samples``
    samples of each, None: all), or why it could not run."""
    command = [sys.executable, "-m", "torch.distributed.tensor._ops.strategy_validation",
               "--op", ops, "--world-size", "4", "--device", "cpu"]
    if max_samples is not None:
        command += ["--max-samples", str(max_samples)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"DTensor's validator failed ({tail[0]}); install the bench extra (expecttest)"
    combos = sum(int(n) for n in re.findall(r"Combinations: (\d+)", done.stdout))
    if not combos:
        return f"DTensor's validator reported no combination (its output format changed?): {done.stdout[-200:]!r}"
    total = re.search(r"^Total\s+\d+\s+\d+\s+\d+\s+([\d.]+)s", done.stdout, re.MULTILINE)
    return combos, float(total.group(1)) if total else wall


def dtensor_baseline(ops: str = "sum,mm,softmax", max_samples: int | None = None) -> float | None:
    """Run DTensor's validator on ``ops``, print its figures, return its ms per combination
    (None when it could not run: the reason is printed on stderr; the caller fails)."""
    found = dtensor_rate(ops, max_samples)
    if isinstance(found, str):
        print(found, file=sys.stderr)
        return None
    combos, seconds = found
    baseline = 1000 * seconds / max(combos, 1)
    print(f"DTensor validator ({ops.replace(',', ', ')}; 1-D mesh of 4, forward): {combos} combinations in "
          f"{seconds:.1f}s = {baseline:.2f} ms each")
    return baseline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--meshes", nargs="+", type=parse_mesh, default=[(4,), (2, 2), (2, 2, 2)],
                        help="mesh shapes for the audit (default: 4 2,2 2,2,2)")
    parser.add_argument("--no-dtensor", action="store_true", help="skip DTensor's validator")
    parser.add_argument("--quick", action="store_true",
                        help="CI's smoke run: meshes 4 and 2,2, DTensor's validator on 2 samples of sum")
    args = parser.parse_args(argv)
    if args.quick:
        args.meshes = [(4,), (2, 2)]

    baseline = None if args.no_dtensor else dtensor_baseline(*(("sum", 2) if args.quick else ("sum,mm,softmax",)))
    if baseline is None and not args.no_dtensor:
        return 1   # a figure asked for and not measured
    for mesh in args.meshes:
        decided, seconds = audit_rate(tuple(mesh))
        ms = 1000 * seconds / max(decided, 1)
        ratio = f", {baseline / ms:.0f}x faster than DTensor's validator" if baseline else ""
        print(f"audit decision (sum, mm, softmax; mesh {list(mesh)}): {decided} combinations in "
              f"{seconds:.2f}s = {ms:.3f} ms each{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
