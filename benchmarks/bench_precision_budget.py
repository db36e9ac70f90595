"""How much more a correct sharded run loses in low precision than the single-device op.

For every generated strategy of every op spec case, on each of its meshes, in float16 and
bfloat16 (or float32): the largest (sharded max abs error) / (single-device max abs error in the
same dtype) over every rank, output and gradient, and the same against the budget a check over
the first is judged by (the worse of it and the op's own error at each rank's shapes,
verify/local_errors.py). BUDGET_FACTOR (verify/precision.py) must sit well above the second
ratio, or correct strategies fail. ``--scale N``: each spec's first case with its free dims
times N (bench_verify.scaled_case), the long reductions a real model makes.

    python benchmarks/bench_precision_budget.py [SPEC ...] [--dtype float16 --dtype bfloat16] [--scale 8]
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", help="op spec names (default: every op spec)")
    parser.add_argument("--dtype", action="append", choices=("float16", "bfloat16", "float32"), default=None)
    parser.add_argument("--scale", type=int, default=1, help="the first case only, its free dims times N")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--quick", action="store_true",
                        help="CI's smoke run: the sum spec's first case (default specs), bfloat16 (default dtype)")
    args = parser.parse_args()
    cases = 1 if args.quick or args.scale > 1 else None
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
    from bench_verify import scaled_case

    exact = Tolerance(0.0, 0.0)   # report every difference, however small
    for dtype in args.dtype or ["float16", "bfloat16"]:
        for spec in load_op_specs(args.root, None, args.specs):
            worst, where, checks = [0.0, 0.0], ["", ""], 0
            for mesh in spec.verify.meshes:
                with SimulatedBackend(DeviceMesh(mesh), timeout=600) as backend:
                    for case_id, case in list(spec.op_cases())[:cases]:
                        case = scaled_case(case, args.scale).case if args.scale > 1 else case
                        graph_module, node_name = case.build()
                        for strategy in strategies_for_node(graph_module, node_name, backend.mesh):
                            checks += 1
                            found = [m for m in _run_check(backend, case, strategy, dtype, exact, 600.0)
                                     if m.kind == "values"]
                            for i, at_ranks in enumerate((False, True)):
                                budgets = error_budgets(case, strategy, getattr(torch, dtype),
                                                        at_rank_shapes=at_ranks) if found else {}
                                for m in found:
                                    if budgets.get(m.tensor, 0.0) > 0 and m.max_abs_err / budgets[m.tensor] > worst[i]:
                                        worst[i] = m.max_abs_err / budgets[m.tensor]
                                        where[i] = f"{case_id} {strategy.name!r} mesh {list(mesh)} {m.tensor}"
            if not checks:
                raise SystemExit(f"bench_precision_budget: {spec.name} gave no strategy to check in {dtype}")
            print(f"{dtype:9} {spec.name:12} {checks:5} checks  worst ratio {worst[0]:5.2f} to the single-device "
                  f"error, {worst[1]:5.2f} at the ranks' shapes (budget factor {BUDGET_FACTOR:g})  "
                  f"{where[0]}{'' if where[1] == where[0] else f'; at the ranks: {where[1]}'}")


if __name__ == "__main__":
    main()
