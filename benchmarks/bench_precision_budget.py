"""How much more a correct sharded run loses in low precision than the single-device op.

For every generated strategy of every op spec case, on each of its meshes, in float16 and
bfloat16: the largest (sharded max abs error) / (single-device max abs error in the same
dtype) over every rank, output and gradient. BUDGET_FACTOR (verify/precision.py) must sit
well above the worst ratio printed here, or correct strategies fail.

    python benchmarks/bench_precision_budget.py [SPEC ...] [--dtype float16 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", help="op spec names (default: every op spec)")
    parser.add_argument("--dtype", action="append", choices=("float16", "bfloat16"), default=None)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--quick", action="store_true",
                        help="CI's smoke run: the sum spec's first case (default specs), bfloat16 (default dtype)")
    args = parser.parse_args()
    cases = 1 if args.quick else None
    if args.quick:
        args.specs, args.dtype = args.specs or ["sum"], args.dtype or ["bfloat16"]

    import torch

    from shardverify.strategies.for_node import strategies_for_node
    from shardverify.backends import SimulatedBackend
    from shardverify.spec.catalogue import load_op_specs
    from shardverify.sharding.mesh import DeviceMesh
    from shardverify.verify.engine import _run_check
    from shardverify.verify.precision import BUDGET_FACTOR, error_budgets
    from shardverify.verify.tolerance import Tolerance

    exact = Tolerance(0.0, 0.0)   # report every difference, however small
    for dtype in args.dtype or ["float16", "bfloat16"]:
        for spec in load_op_specs(args.root, None, args.specs):
            worst, where, checks = 0.0, "", 0
            for mesh in spec.verify.meshes:
                with SimulatedBackend(DeviceMesh(mesh)) as backend:
                    for case_id, case in list(spec.op_cases())[:cases]:
                        graph_module, node_name = case.build()
                        for strategy in strategies_for_node(graph_module, node_name, backend.mesh):
                            checks += 1
                            budgets = error_budgets(case, strategy, getattr(torch, dtype))
                            for m in _run_check(backend, case, strategy, dtype, exact, 60.0):
                                if m.kind == "values" and budgets.get(m.tensor, 0.0) > 0:
                                    ratio = m.max_abs_err / budgets[m.tensor]
                                    if ratio > worst:
                                        worst, where = ratio, f"{case_id} {strategy.name!r} mesh {list(mesh)} {m.tensor}"
            if not checks:
                raise SystemExit(f"bench_precision_budget: {spec.name} gave no strategy to check in {dtype}")
            print(f"{dtype:9} {spec.name:12} {checks:5} checks  worst ratio {worst:5.2f} "
                  f"(budget factor {BUDGET_FACTOR:g})  {where}")


if __name__ == "__main__":
    main()
