"""How long does `shardverify dtensor` take per executed combination, against DTensor's own
strategy validator on the same ops?

Runs, in this one process run:
  * DTensor's validator (``python -m torch.distributed.tensor._ops.strategy_validation --op
    sum,mm,softmax --world-size 4 --device cpu``: forward only, one 1-D mesh, even shapes; needs
    the ``bench`` extra, expecttest), and reads how many combinations it decided and in how long;
  * shardverify's DTensor execution of the same three ops (sum, mm, softmax cases built here) on
    the meshes given: every input layout combination (one per symmetry orbit, partial inputs,
    uneven and strided layouts included), executed forward and backward on every rank under
    LocalTensorMode with DTensor's rule asked beside it, then classified;
and prints ms per combination for each, their ratio and the machine's load. The two do different
work per combination (the validator runs the op on local shards without DTensor's dispatch; the
execution runs DTensor itself, its backward and its rule), so the ratio is a cost, not a race.

Usage: .venv/bin/python benchmarks/bench_dtensor_exec.py [--meshes 4 2,2 2,3] [--no-dtensor]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

from bench_audit import CASES, dtensor_baseline

from shardverify.features.audit.decide import Operand, prepare
from shardverify.features.audit.layouts import tensor_layouts
from shardverify.cli.verify_cmd import parse_mesh
from shardverify.features.dtensor.run import CaseResult, execute_combos, present_combinations
from shardverify.sharding.mesh import DeviceMesh


def execution_rate(mesh_shape: tuple[int, ...], ops: tuple[str, ...] = tuple(CASES)) -> tuple[int, float, dict]:
    """(combinations executed, seconds, counts per class) over ``ops`` (default: the three) on one mesh."""
    executed, seconds, counts = 0, 0.0, {}
    for name in ops:
        case, shapes = CASES[name]
        operands = tuple(Operand(n, n, ("arg", i), shape, True) for i, (n, shape) in enumerate(shapes))
        problem = prepare(case, DeviceMesh(mesh_shape), operands)
        choices = [tensor_layouts(o.shape, mesh_shape) for o in operands]
        combos = present_combinations(itertools.product(*choices))
        result = CaseResult(name, name, tuple(mesh_shape))
        start = time.perf_counter()
        execute_combos(result, problem, operands, combos, problem.decide, None)
        seconds += time.perf_counter() - start
        executed += result.executed
        for klass, n in result.counts.items():
            counts[klass] = counts.get(klass, 0) + n
    return executed, seconds, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--meshes", nargs="+", type=parse_mesh, default=[(4,), (2, 2), (2, 3)],
                        help="mesh shapes for the execution (default: 4 2,2 2,3)")
    parser.add_argument("--no-dtensor", action="store_true", help="skip DTensor's validator")
    parser.add_argument("--quick", action="store_true",
                        help="CI's smoke run: sum on mesh 4 only, DTensor's validator on 2 samples of sum")
    args = parser.parse_args(argv)
    if args.quick:
        args.meshes = [(4,)]

    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    baseline = None if args.no_dtensor else dtensor_baseline(*(("sum", 2) if args.quick else ("sum,mm,softmax",)))
    if baseline is None and not args.no_dtensor:
        return 1   # a figure asked for and not measured
    for mesh in args.meshes:
        executed, seconds, counts = execution_rate(tuple(mesh), ("sum",) if args.quick else tuple(CASES))
        if not executed:
            print(f"no combination executed on mesh {list(mesh)}", file=sys.stderr)
            return 1
        ms = 1000 * seconds / max(executed, 1)
        ratio = f", {ms / baseline:.1f}x the validator's time" if baseline else ""
        shown = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        ops = "sum" if args.quick else "sum, mm, softmax"
        print(f"DTensor executed ({ops}; mesh {list(mesh)}, forward + backward + rule): {executed} "
              f"combinations in {seconds:.2f}s = {ms:.2f} ms each{ratio} [{shown}]")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
