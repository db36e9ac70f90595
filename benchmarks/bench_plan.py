"""MLP block plans on gloo: measured step time next to the declared cost.

For the shipped MLP spec (specs/plans/mlp.yaml, Linear-GELU-Linear) on a (2, 2) mesh of gloo
processes, times one float32 training step (forward + backward, the slowest rank, after a
warm-up) under the solver's plan and the hand-written plans, and prints each plan's declared
cost beside it, both relative to the replicated plan measured in the same run. Costs are
declared twice: with the mesh's default alpha-beta and multiply rate, and with values
calibrated on the same gloo pool in the same run (the alpha-beta fit of `shardverify
calibrate`, backends/calibration.py, over a few payload sizes; a local matmul for the
multiply rate); the solver is run under both::

    .venv/bin/python benchmarks/bench_plan.py              # the spec's sizes, 10 steps
    .venv/bin/python benchmarks/bench_plan.py --quick      # 3 steps
    .venv/bin/python benchmarks/bench_plan.py --scale 4    # hidden sizes x4

The last line says whether the declared costs rank the plans as the measurements do.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time

import torch
import yaml

from shardverify.backends.calibration import fit_mesh, measure, measure_rate
from shardverify.backends.process import ProcessBackend
from shardverify.sharding.mesh import DeviceMesh
from shardverify.plan.device import NOMINAL
from shardverify.plan.execute import sharded_forward
from shardverify.plan.model import Plan
from shardverify.plan.recipe import TRACE_LOCK, ModelRecipe, traced
from shardverify.plan.spec import SOLVER, build_spec_model
from shardverify.plan.verify import make_plan

SPEC = "specs/plans/mlp.yaml"
#: payloads (bytes per rank) the alpha-beta fit times: latency-bound to bandwidth-bound
PAYLOADS = (1 << 10, 1 << 16, 1 << 22)


def rank_time_plan(comm, recipe: ModelRecipe, plan: Plan, steps: int = 5) -> float:
    """Mean seconds of one sharded training step (forward + backward) on this rank, float32."""
    with TRACE_LOCK:
        gm = traced(recipe)
        gm = (copy.deepcopy(gm) if recipe.graph is not None else gm).float()   # the planned graph stays float64
    recipe = ModelRecipe(recipe.module, tuple(x.float() if x.is_floating_point() else x for x in recipe.inputs),
                         recipe.seed, recipe.capture, gm)
    comm.barrier()
    seconds = []
    for _ in range(steps + 1):
        comm.barrier()
        start = time.perf_counter()
        *_, result = sharded_forward(comm, gm, recipe, plan)
        out = result if isinstance(result, torch.Tensor) else result[0]
        out.backward(torch.ones_like(out))
        comm.barrier()
        seconds.append(time.perf_counter() - start)
    return sum(seconds[1:]) / steps


def calibrated_mesh(backend, repeats: int) -> tuple[DeviceMesh, float]:
    """The backend's mesh with per-axis alpha and beta fitted as `shardverify calibrate` fits
    them, and the slowest rank's multiply rate."""
    mesh = backend.mesh
    fits = fit_mesh(mesh.shape, measure(backend, PAYLOADS, repeats=repeats))
    rate = measure_rate(backend)
    return DeviceMesh(mesh.shape, alpha=tuple(f.alpha for f in fits), beta=tuple(f.beta for f in fits)), rate


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
    rows, choices = [], []
    backend = ProcessBackend(mesh, backend="gloo")
    try:
        calibrated, rate = calibrated_mesh(backend, 3 if args.quick else 10)
        # this machine as a device profile: its measured multiply rate (the links are the calibrated mesh's)
        measured = dataclasses.replace(NOMINAL, name="measured", about="this machine's gloo ranks, measured",
                                       multiply_adds_per_s=rate)
        print(f"calibrated: alpha {['%.3g' % a for a in calibrated.alpha]} s, beta "
              f"{['%.3g' % b for b in calibrated.beta]} s/B, {rate:.3g} multiplies/s "
              f"(defaults: alpha {mesh.alpha[0]:.3g}, beta {mesh.beta[0]:.3g}, 1e10)")
        plans = [(name, None if plan == SOLVER else plan) for name, plan in raw["plans"].items()]
        plans.append(("solver_calib", "calibrated"))
        for name, plan in plans:
            if plan == "calibrated":
                chosen = make_plan(module, example, calibrated, None, device=measured)
            else:
                chosen = make_plan(module, example, mesh, plan)
            recosted = make_plan(module, example, calibrated, chosen.choices(), device=measured)
            same = next((r[0] for r, c in zip(rows, choices) if c == chosen.choices()), None)
            choices.append(chosen.choices())
            name = name if same is None else f"{name}(={same})"
            times = backend.run(rank_time_plan, ModelRecipe(module, example), chosen, steps)
            declared = make_plan(module, example, mesh, chosen.choices()).cost.total
            rows.append((name, declared, recosted.cost.total, max(times)))
    finally:
        backend.close()
    base = next((r for r in rows if r[0] == "replicated"), rows[0])
    print(f"{'plan':<24}{'declared s':>11}{'vs repl':>8}{'calibr. s':>11}{'vs repl':>8}{'measured s':>12}{'vs repl':>8}")
    for name, cost, calib, seconds in rows:
        print(f"{name:<24}{cost:>11.3g}{cost / base[1]:>8.2f}{calib:>11.3g}{calib / base[2]:>8.2f}"
              f"{seconds:>12.4g}{seconds / base[3]:>8.2f}")
    for label, index in (("declared", 1), ("calibrated", 2), ("measured", 3)):
        print(f"{label + ' order:':<20}{' < '.join(r[0] for r in sorted(rows, key=lambda r: r[index]))}")
    order = [[r[0] for r in sorted(rows, key=lambda r: r[i])] for i in (1, 2, 3)]
    print(f"same ranking as measured: declared {'yes' if order[0] == order[2] else 'no'}, "
          f"calibrated {'yes' if order[1] == order[2] else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
