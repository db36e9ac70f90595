"""How fast is verification, and what does the persistent worker pool buy?

Prints:
  * pool start-up: spawning the gloo ranks and joining their process groups, then the first
    check (each worker's one-off imports and tracing warm-up) separately;
  * steady-state strategy checks per second on the simulated mesh and on the gloo pool;
  * the time to verify every case of the linear and sum specs with one persistent pool
    versus a fresh pool started for each case, and their ratio, measured in this one run.

Usage: .venv/bin/python benchmarks/bench_verify.py [--mesh 2,2] [--specs linear sum] [--fresh-cases N]
(--fresh-cases limits how many cases the slow fresh-pool pass runs; the persistent pass then
runs the same cases, so the ratio stays like for like).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from shardverify.api import strategies_for_node
from shardverify.backends import SimulatedBackend
from shardverify.backends.process import ProcessBackend
from shardverify.cli.verify_cmd import load_op_specs, parse_mesh
from shardverify.mesh import DeviceMesh
from shardverify.verify.engine import verify_case
from shardverify.verify.report import assert_passed

REPO = Path(__file__).resolve().parents[1]


def checks_per_second(backend, cases, min_seconds: float = 3.0) -> tuple[float, int]:
    """Verify the cases over and over (after one warm-up pass) for at least ``min_seconds``."""
    for case in cases:
        assert_passed(verify_case(backend, case))
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        for case in cases:
            results = verify_case(backend, case)
            assert_passed(results)
            done += len(results)
    return done / (time.perf_counter() - start), done


def verify_all(make_backend, cases, fresh: bool) -> tuple[float, int]:
    """Seconds to verify every case: one backend for all, or a new one per case."""
    start, checks = time.perf_counter(), 0
    backend = None if fresh else make_backend()
    try:
        for case in cases:
            if fresh:
                backend = make_backend()
            try:
                results = verify_case(backend, case)
                assert_passed(results)
                checks += len(results)
            finally:
                if fresh:
                    backend.close()
    finally:
        if not fresh:
            backend.close()
    return time.perf_counter() - start, checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", type=parse_mesh, default=(2, 2))
    parser.add_argument("--specs", nargs="+", default=["linear", "sum"])
    parser.add_argument("--fresh-cases", type=int, default=None,
                        help="verify only the first N cases in the pool-versus-fresh comparison")
    args = parser.parse_args()
    mesh = DeviceMesh(args.mesh)
    cases = [case for spec in load_op_specs(REPO, None, args.specs) for _, case in spec.op_cases()]
    for case in cases:   # trace once here so neither pass pays for this process's tracing
        graph_module, node_name = case.build()
        strategies_for_node(graph_module, node_name, mesh)
    print(f"mesh {mesh.shape}, specs {args.specs}: {len(cases)} cases")

    began = time.perf_counter()
    pool = ProcessBackend(mesh, backend="gloo", timeout=120)
    pool.start()
    startup = time.perf_counter() - began
    began = time.perf_counter()
    assert_passed(verify_case(pool, cases[0]))
    first = time.perf_counter() - began
    print(f"gloo pool start-up ({mesh.size} ranks): {startup:.2f}s; first case (worker warm-up): {first:.2f}s")

    sample = cases[:2]
    with SimulatedBackend(mesh, timeout=120) as simulated:
        rate, n = checks_per_second(simulated, sample)
    print(f"simulated: {rate:.1f} strategy checks/s ({n} checks)")
    rate, n = checks_per_second(pool, sample)
    print(f"gloo pool: {rate:.1f} strategy checks/s ({n} checks)")
    pool.close()

    chosen = cases if args.fresh_cases is None else cases[:args.fresh_cases]

    def make():
        backend = ProcessBackend(mesh, backend="gloo", timeout=120)
        backend.start()
        return backend

    persistent, checks = verify_all(make, chosen, fresh=False)
    fresh, fresh_checks = verify_all(make, chosen, fresh=True)
    assert checks == fresh_checks
    print(f"verify {len(chosen)} cases ({checks} strategy checks) of {'+'.join(args.specs)} on gloo:")
    print(f"  persistent pool (started once, included): {persistent:.1f}s")
    print(f"  fresh processes for each case:            {fresh:.1f}s")
    print(f"  ratio fresh / persistent:                 {fresh / persistent:.1f}x")


if __name__ == "__main__":
    main()
