"""`verify`'s rows per second on Ray workers against the local `--jobs` pool, on the same rows.

The same plan of (case, mesh) rows (specs x meshes) runs, for each number of workers, on the local
forkserver pool (cli/verify_jobs.py) and as units (backends/units.py) on that many actors of a
Ray started in this process (backends/ray_units.py, one CPU each).  Per run it prints the wall
seconds from the call to the last row (worker start included), the seconds to the first row
(mostly worker start: imports and the first row's warm-up), rows per second overall, and rows per
second after the first row (the steady rate).  Every run must give every row with no error, or
the benchmark fails: a rate of lost rows is no figure::

    .venv/bin/python benchmarks/bench_cluster.py            # 1, 2, 4 workers; mm relu sum on (2,) and (2,2)
    .venv/bin/python benchmarks/bench_cluster.py --quick    # 1, 2 workers; mm relu on (2,) (CI's smoke run)

Then `shardverify dtensor`'s cases (units of about a second): the serial run in this process
against the sweep on Ray workers (dtensor/sweep.py), the same figures per case, and the time per
case one Ray worker adds after its first case (the path's overhead; target under 10%).

Needs ray (pip install 'shardverify[cluster]'); without it the script says so and exits 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class _Clock:
    """Times of the rows' ends, as a Progress (the pool's) or a done callback (the units') sees them."""

    def __init__(self) -> None:
        self.started, self.ends = time.perf_counter(), []

    def step(self, count: int = 1) -> None:
        self.ends.extend([time.perf_counter()] * count)

    def show(self, label: str = "") -> None:
        pass

    def close(self) -> None:
        pass

    def done(self, index: int, value) -> None:
        self.step()

    def figures(self, rows: int) -> dict:
        if len(self.ends) != rows:
            raise SystemExit(f"bench_cluster: {len(self.ends)} row end(s) seen for {rows} rows")
        wall, first = self.ends[-1] - self.started, self.ends[0] - self.started
        steady = (rows - 1) / (self.ends[-1] - self.ends[0]) if rows > 1 and self.ends[-1] > self.ends[0] else 0.0
        return {"wall": wall, "first": first, "rate": rows / wall, "steady": steady}


def plan_of(specs: list[str], meshes: list[tuple[int, ...]]) -> list[tuple]:
    from shardverify.spec.catalogue import load_op_specs

    return [(spec.name, case_id, case, mesh) for spec in load_op_specs(REPO, None, specs)
            for case_id, case in spec.op_cases() for mesh in meshes]


def _checked(rows: list, plan: list, where: str) -> None:
    bad = [row for row in rows if not hasattr(row, "error") or row.error]
    if len(rows) != len(plan) or bad:
        raise SystemExit(f"bench_cluster: {where} gave {len(rows)} rows for {len(plan)}, "
                         f"{len(bad)} with an error: {bad[:1]}")


def on_pool(plan: list, workers: int) -> dict:
    from shardverify.cli.verify_jobs import verify_rows_in_workers

    clock = _Clock()
    rows = verify_rows_in_workers(plan, workers, device=None, timeout=60.0, progress=clock)
    _checked(rows, plan, f"the local pool of {workers}")
    return clock.figures(len(plan))


def on_ray(plan: list, workers: int) -> dict:
    from shardverify.backends.ray_units import RayEngine
    from shardverify.backends.units import Unit, run_units
    from shardverify.cli.verify_cluster import _start_actor
    from shardverify.cli.verify_rows import row_label, worker_row

    units = [Unit(worker_row, (item, None, 60.0, False), row_label(item)) for item in plan]
    clock = _Clock()
    with RayEngine("local", workers, setup=_start_actor) as engine:   # joins the Ray started in main
        rows = run_units(units, engine, clock.done)
    _checked(rows, plan, f"Ray with {workers} worker(s)")
    return clock.figures(len(plan))


def dtensor_runs(spec_names: list[str], mesh: tuple[int, ...], limit: int, workers: list[int]) -> None:
    """`shardverify dtensor`'s cases: the serial run in this process against the sweep on that many
    Ray workers (dtensor/sweep.py); the same cases, none with an error, or the benchmark fails."""
    from shardverify.backends.ray_units import RayEngine
    from shardverify.cli.dtensor_cluster import WORKER_SETUP, _case_counting_warnings
    from shardverify.features.dtensor.run import run_spec
    from shardverify.features.dtensor.sweep import sweep
    from shardverify.spec.catalogue import load_op_specs

    specs = load_op_specs(REPO, None, spec_names)
    clock = _Clock()
    serial = [r for spec in specs for r in run_spec(spec, [mesh], limit=limit, on_result=lambda r: clock.step())]
    expected = [(r.op, r.case) for r in serial]
    print(f"{len(serial)} DTensor cases ({' '.join(spec_names)} on {mesh}, --limit {limit}), each a unit; "
          "wall seconds to the last case, to the first, cases/s overall and after the first")
    rates = {"serial": clock.figures(len(serial))}
    for count in workers:
        clock = _Clock()
        with RayEngine("local", count, setup=WORKER_SETUP) as engine:
            swept = sweep(specs, [mesh], engine, limit=limit, call=_case_counting_warnings,
                          on_finished=lambda label, value: clock.step())
        if [(r.op, r.case) for r in swept] != expected or any(r.note.startswith("error:") for r in swept):
            raise SystemExit(f"bench_cluster: the sweep on {count} Ray worker(s) did not give the serial run's cases")
        rates[f"ray x{count}"] = clock.figures(len(swept))
    for name, f in rates.items():
        print(f"{name:>10}: {f['wall']:6.1f} s  first {f['first']:5.1f} s  {f['rate']:5.2f} cases/s  "
              f"steady {f['steady']:5.2f} cases/s", flush=True)
    if "ray x1" in rates and rates["ray x1"]["steady"]:
        print(f"one Ray worker after its first case against this process after its first: "
              f"{rates['serial']['steady'] / rates['ray x1']['steady'] - 1:+.0%} time per case (target: under 10%)")


def _start_forkserver() -> None:
    """The pool's forkserver with its imports, started before any run is timed (as Ray is): one
    process forked from it is back when its imports are done."""
    import concurrent.futures
    import multiprocessing
    import os

    from shardverify.backends.signals import start_forkserver
    from shardverify.cli.verify_rows import WORKER_PRELOAD

    context = multiprocessing.get_context("forkserver")
    start_forkserver(context, WORKER_PRELOAD)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        pool.submit(os.getpid).result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 and 2 workers on mm and relu, mesh (2,) (CI's smoke run)")
    parser.add_argument("--workers", type=int, nargs="+", default=None, help="worker counts (default: 1 2 4)")
    parser.add_argument("--specs", nargs="+", default=None, help="specs (default: mm relu sum)")
    parser.add_argument("--dtensor-specs", nargs="*", default=None,
                        help="specs whose `dtensor` cases run serially here and on the workers (default: cumsum "
                             "select on (2,2) at --limit 8; --quick: cumsum at --limit 4; none: no DTensor runs)")
    args = parser.parse_args(argv)
    workers = args.workers or ([1, 2] if args.quick else [1, 2, 4])
    specs = args.specs or (["mm", "relu"] if args.quick else ["mm", "relu", "sum"])
    meshes = [(2,)] if args.quick else [(2,), (2, 2)]
    try:
        import ray
    except ImportError:
        print("bench_cluster: needs ray: pip install 'shardverify[cluster]'", file=sys.stderr)
        return 2
    import logging

    plan = plan_of(specs, meshes)
    print(f"{len(plan)} rows ({' '.join(specs)} on {', '.join(map(str, meshes))}); wall seconds to the last row, "
          "to the first, rows/s overall and after the first")
    began = time.perf_counter()
    _start_forkserver()
    forkserver = time.perf_counter() - began
    began = time.perf_counter()
    ray.init(address="local", num_cpus=max(workers), include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    print(f"start-up, once per run of verify: the pool's forkserver {forkserver:.1f} s, a local Ray "
          f"(--cluster local) {time.perf_counter() - began:.1f} s", flush=True)
    try:
        for count in workers:
            for name, run in (("local pool", on_pool), ("ray", on_ray)):
                f = run(plan, count)
                print(f"{name:>10} x{count}: {f['wall']:6.1f} s  first {f['first']:5.1f} s  "
                      f"{f['rate']:5.2f} rows/s  steady {f['steady']:5.2f} rows/s", flush=True)
        dtensor = args.dtensor_specs if args.dtensor_specs is not None else (
            ["cumsum"] if args.quick else ["cumsum", "select"])
        if dtensor:
            dtensor_runs(dtensor, (2, 2), 4 if args.quick else 8, workers)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
