"""What a checking process keeps from one case to the next: resident memory over a run of cases.

Checks the cases of one spec's grid (default: sum, after its Linear) one after another in one
process set up as `shardverify verify` sets itself up (``tune_for_checking``), each case grown
by --scale in its free dims (bench_verify's ``scaled_case``), every strategy of it on the
simulated backend, and prints after each case the resident memory, the bytes of the references
the process keeps and the case's CPU seconds. The figures are in bytes, never the wall clock:

  * first case: the resident memory after the first case, the run's working set;
  * kept per case: the median growth of resident memory from one case to the next, after the
    first, against the bytes of the references the first case left (the floor: the values,
    results and gradients a case is checked against, in each dtype it is checked in, made by
    the references alone). Before verify/memo.py's case tables, each case kept everything made
    from its tensors: 1.85 GB a case of sum at 16x on (2,2), about 12 times its references; now
    a case keeps about its references while they fit their budget, and nothing once it is full;
  * references kept at the end, against ``REFERENCE_BYTES``.

    .venv/bin/python benchmarks/bench_verify_memory.py                    # sum x16 on (2,2), 8 cases
    .venv/bin/python benchmarks/bench_verify_memory.py --spec linear --scale 8 --cases 4
    .venv/bin/python benchmarks/bench_verify_memory.py --quick            # CI's smoke run: x2, 3 cases

A case that fails, or a run that measures nothing, ends the benchmark with exit status 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _kept_references() -> tuple[int, int]:
    """(bytes, count) of the references the process keeps (one kept under two keys counts once)."""
    from shardverify.verify import reference as reference_module

    kept = {id(ref): ref for ref in reference_module._REFERENCES.values()}
    return sum(ref.held_bytes() for ref in kept.values()), len(kept)


def run(spec_name: str, mesh_shape: tuple[int, ...], scale: int, cases: int) -> dict:
    """Check the first ``cases`` cases of ``spec_name`` grown ``scale`` times on ``mesh_shape``,
    one after another: the figures of the module docstring."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_verify import scaled_case

    from shardverify.backends import SimulatedBackend
    from shardverify.backends.gc_policy import tune_for_checking
    from shardverify.sharding.mesh import DeviceMesh
    from shardverify.spec.catalogue import load_op_specs
    from shardverify.strategies.for_node import strategies_for_node
    from shardverify.verify.engine import verify_case
    from shardverify.verify.reference import REFERENCE_BYTES

    tune_for_checking()
    spec = load_op_specs(REPO, None, [spec_name])[0]
    chosen = [case for _, case in spec.op_cases()][:cases]
    if not chosen:
        raise SystemExit(f"spec {spec_name!r} has no case to check")
    mesh = DeviceMesh(mesh_shape)
    rows = []
    with SimulatedBackend(mesh, timeout=600) as backend:
        for case in chosen:
            grown = scaled_case(case, scale).case if scale > 1 else case
            graph_module, node = grown.build()
            strategies = list(strategies_for_node(graph_module, node, mesh))
            began = time.process_time()
            results = verify_case(backend, grown, strategies)
            seconds = time.process_time() - began
            failed = [r.strategy for r in results if not r.passed]
            if not results or failed:
                raise SystemExit(f"{grown.describe()}: {len(failed)} of {len(results)} strategies failed: {failed[:3]}")
            kept, count = _kept_references()
            rows.append({"case": grown.describe(), "strategies": len(results), "cpu_s": seconds, "rss": _rss_bytes(),
                         "references": kept, "kept": count})
    growth = [b["rss"] - a["rss"] for a, b in zip(rows, rows[1:])]
    return {"rows": rows, "first_rss": rows[0]["rss"], "per_case": statistics.median(growth) if growth else None,
            "floor": rows[0]["references"], "budget": REFERENCE_BYTES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="sum")
    parser.add_argument("--mesh", default="2,2", help="mesh shape, e.g. 2,2 or 4")
    parser.add_argument("--scale", type=int, default=16, help="the cases' free dims multiplied by this (default 16)")
    parser.add_argument("--cases", type=int, default=8, help="cases of the spec's grid, from its first (default 8)")
    parser.add_argument("--quick", action="store_true", help="CI's smoke run: x2, 3 cases (figures not for quoting)")
    args = parser.parse_args(argv)
    if args.quick:
        args.scale, args.cases = 2, 3
    if args.cases < 2:
        parser.error("--cases must be 2 or more: the growth is measured from one case to the next")
    mesh = tuple(int(n) for n in args.mesh.split(","))
    found = run(args.spec, mesh, args.scale, args.cases)
    mib = 2 ** 20
    print(f"{args.spec} x{args.scale} on {mesh}, {len(found['rows'])} cases one after another (CPU s; MiB)")
    print(f"{'case':<64}{'strategies':>11}{'CPU s':>8}{'resident':>10}{'references':>12}{'kept':>6}")
    for row in found["rows"]:
        print(f"{row['case'][:63]:<64}{row['strategies']:>11}{row['cpu_s']:>8.1f}{row['rss'] / mib:>10.0f}"
              f"{row['references'] / mib:>12.0f}{row['kept']:>6}")
    per_case, floor = found["per_case"], found["floor"]
    print(f"first case: {found['first_rss'] / mib:.0f} MiB resident; kept per case after it (median): "
          f"{per_case / mib:.1f} MiB, {per_case / floor:.2f}x the first case's references ({floor / mib:.1f} MiB)")
    last = found["rows"][-1]
    print(f"references kept at the end: {last['references'] / mib:.0f} MiB in {last['kept']} "
          f"(budget {found['budget'] / mib:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
