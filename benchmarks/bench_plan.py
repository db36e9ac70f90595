"""MLP block plans on gloo: measured step time next to the declared cost.

For the shipped MLP spec (specs/plans/mlp.yaml, Linear-GELU-Linear) on a (2, 2) mesh of gloo
processes, times one float32 training step (forward + backward, the slowest rank, after a
warm-up) under the solver's plan and the hand-written plans, and prints each plan's declared
cost beside it, both relative to the replicated plan measured in the same run::

    .venv/bin/python benchmarks/bench_plan.py              # the spec's sizes, 10 steps
    .venv/bin/python benchmarks/bench_plan.py --quick      # 3 steps
    .venv/bin/python benchmarks/bench_plan.py --scale 4    # hidden sizes x4

The last line says whether the declared costs rank the plans as the measurements do.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from shardverify.backends.process import ProcessBackend
from shardverify.mesh import DeviceMesh
from shardverify.plan.execute import ModelRecipe, rank_time_plan
from shardverify.plan.spec import SOLVER, build_spec_model
from shardverify.plan.verify import make_plan

SPEC = "specs/plans/mlp.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 timed steps instead of 10")
    parser.add_argument("--scale", type=int, default=1, help="multiply the model's sizes and batch")
    parser.add_argument("--spec", default=SPEC)
    args = parser.parse_args(argv)
    with open(args.spec) as handle:
        raw = yaml.safe_load(handle)
    kwargs = tuple((k, v * args.scale) for k, v in raw["model"]["kwargs"].items())
    inputs = tuple((k, tuple(s * args.scale for s in v)) for k, v in raw["inputs"].items())
    mesh = DeviceMesh(tuple(raw["mesh"]))
    module, example = build_spec_model(raw["model"]["factory"], kwargs, inputs)
    steps = 3 if args.quick else 10
    rows = []
    backend = ProcessBackend(mesh, backend="gloo")
    try:
        for name, plan in raw["plans"].items():
            chosen = make_plan(module, example, mesh.shape, None if plan == SOLVER else plan)
            times = backend.run(rank_time_plan, ModelRecipe(module, example), chosen, steps)
            rows.append((name, chosen.cost.total, max(times)))
    finally:
        backend.close()
    base = dict((n, (c, t)) for n, c, t in rows).get("replicated", (rows[0][1], rows[0][2]))
    print(f"{'plan':<16}{'declared s':>12}{'vs repl.':>10}{'measured s':>12}{'vs repl.':>10}")
    for name, cost, seconds in rows:
        print(f"{name:<16}{cost:>12.3g}{cost / base[0]:>10.2f}{seconds:>12.4g}{seconds / base[1]:>10.2f}")
    by_cost = [n for n, _, _ in sorted(rows, key=lambda r: r[1])]
    by_time = [n for n, _, _ in sorted(rows, key=lambda r: r[2])]
    same = "yes" if by_cost == by_time else "no"
    print(f"declared order: {' < '.join(by_cost)}\nmeasured order: {' < '.join(by_time)}\nsame ranking: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
