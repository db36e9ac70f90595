"""Verification on demand, priced on a real model: a zoo language model planned and verified end to
end three times in one process, each on a fresh capture:

1. ``--verified-only``: the baseline, calls outside their spec's grid refused (no on-demand work);
2. cold: every call outside its grid verified where it is met, into an empty verdict folder;
3. warm: the same, every verdict read back from that folder.

For each it prints the plan check's seconds (capture, strategies, solver, the end-to-end run) and
the seconds spent on calls outside the grid: verifying them (cold) or finding their verdicts
(warm), the latter as a share of the warm plan check (the target: under 5%)::

    .venv/bin/python benchmarks/bench_on_demand.py             # zoo:llama on (2, 2)
    .venv/bin/python benchmarks/bench_on_demand.py --quick     # zoo:gpt2 on (2,)
    .venv/bin/python benchmarks/bench_on_demand.py --model bert --mesh 4

A figure it cannot measure (a plan that fails, no call outside the grid) is an error: exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from shardverify.plan.hf_zoo import hf_model
from shardverify.plan.verify import verify_plan
from shardverify.verify.on_demand import CACHE_ENV


def _run(name: str, mesh: tuple[int, ...], verified_only: bool) -> tuple[float, dict | None]:
    model, inputs = hf_model(name)
    start = time.perf_counter()
    result = verify_plan(model, inputs, mesh, capture="export", verified_only=verified_only)
    seconds = time.perf_counter() - start
    if not result.passed:
        raise SystemExit(f"bench_on_demand: the plan of zoo:{name} failed: {result.summary()}")
    return seconds, result.coverage.on_demand


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="zoo:gpt2 on a (2,) mesh")
    parser.add_argument("--model", default=None, help="a zoo model (default: llama; gpt2 with --quick)")
    parser.add_argument("--mesh", default=None, help="mesh shape such as 2,2 (default: 2,2; 2 with --quick)")
    args = parser.parse_args(argv)
    name = args.model or ("gpt2" if args.quick else "llama")
    mesh = tuple(int(s) for s in (args.mesh or ("2" if args.quick else "2,2")).split(","))
    with tempfile.TemporaryDirectory(prefix="bench-on-demand-") as folder:
        os.environ[CACHE_ENV] = folder
        baseline, _ = _run(name, mesh, verified_only=True)
        cold, cold_stats = _run(name, mesh, verified_only=False)
        warm, warm_stats = _run(name, mesh, verified_only=False)
    if not cold_stats or not cold_stats["calls"]:
        print(f"bench_on_demand: zoo:{name} has no call outside its spec's grid: nothing to measure", file=sys.stderr)
        return 1
    if warm_stats["verified"]:
        print(f"bench_on_demand: the warm run verified {warm_stats['verified']} call(s) again: the verdict "
              f"cache missed", file=sys.stderr)
        return 1
    print(f"zoo:{name} on mesh {mesh}, one process, each run on a fresh capture")
    print(f"  --verified-only (baseline)   plan check {baseline:7.2f} s")
    print(f"  on demand, cold              plan check {cold:7.2f} s; {cold_stats['verified']} call(s) verified "
          f"({cold_stats['strategies_verified']} strategies) in {cold_stats['seconds']:.2f} s, "
          f"{cold_stats['cache_hits']} repeated call(s) from the cache")
    share = warm_stats["cache_seconds"] / warm if warm else 0.0
    print(f"  on demand, warm              plan check {warm:7.2f} s; {warm_stats['cache_hits']} verdict(s) read in "
          f"{warm_stats['cache_seconds']:.3f} s = {100 * share:.2f}% of the plan check (target: under 5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
