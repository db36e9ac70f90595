"""Where a zoo plan check's CPU time goes: `shardverify plan zoo:NAME --mesh 2,2`, split.

Each round starts a fresh Python process that runs the command twice, as `shardverify plan`'s
own main: the first run is cold (the process's imports, the tiny model's first build, torch's
first capture), the second warm (the same process again, every import and cache in place). Each
run's ``--json`` gives its CPU seconds per phase (plan/phases.py: this process and the child
processes it waited for, the ILP solver among them):

  start       the interpreter and the command's imports (cold run only; 0 for the warm one)
  build       the tiny HF model built from its config (transformers' model imports included)
  capture     torch.export of the model
  strategies  every node's strategies (calls outside their spec's grid verified on demand, or
              taken from the verdict cache, as the command does)
  solve       the plan problem and the ILP solver (CBC, a child process)
  check       the plan run on the simulated mesh against the single device, forward and backward
  total       all of the above and what lies between them

The figures are the minimum and median over ``--rounds`` rounds (CPU time, never the wall clock).

    .venv/bin/python benchmarks/bench_plan_phases.py                 # gpt2 and llama, 3 rounds
    .venv/bin/python benchmarks/bench_plan_phases.py --quick         # gpt2, 1 round (CI's smoke run)
    .venv/bin/python benchmarks/bench_plan_phases.py --models bert vit --rounds 5 --json

A run that fails or gives no figures ends the benchmark with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ("start", "build", "capture", "strategies", "solve", "check", "total")

#: the driver: the command twice in one process, each run's JSON on a line of its own
_DRIVER = """
import contextlib, io, json, sys
from shardverify.cli.main import main
for run in ("cold", "warm"):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["plan", sys.argv[1], "--mesh", sys.argv[2], "--json"])
    print(json.dumps({"run": run, "status": status, **json.loads(out.getvalue())}), flush=True)
"""


def one_round(model: str, mesh: str) -> dict[str, dict[str, float]]:
    """{"cold": {phase: seconds}, "warm": {...}} of one fresh process."""
    done = subprocess.run([sys.executable, "-c", _DRIVER, f"zoo:{model}", mesh], cwd=REPO, capture_output=True,
                          text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"bench_plan_phases: zoo:{model} exited with status {done.returncode}: "
                         f"{done.stderr[-2000:]}")
    found = {}
    for line in done.stdout.splitlines():
        report = json.loads(line)
        if report["status"] != 0 or not report["passed"]:
            raise SystemExit(f"bench_plan_phases: zoo:{model} ({report['run']}) did not pass: "
                             f"{report['first_divergence'] or report['strict_failures']}")
        seconds = dict(report["cpu_seconds"])
        if report["run"] == "warm":   # the process's CPU before this run is the cold run's
            seconds["start"], seconds["total"] = 0.0, seconds["total"] - found["cold"]["total"]
        found[report["run"]] = seconds
    if set(found) != {"cold", "warm"}:
        raise SystemExit(f"bench_plan_phases: zoo:{model} gave no figures: {done.stdout[-2000:]}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], help="zoo models (default: gpt2 llama)")
    parser.add_argument("--mesh", default="2,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="CI's smoke run: gpt2, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.rounds = ["gpt2"], 1
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    rows = []
    for model in args.models:
        rounds = [one_round(model, args.mesh) for _ in range(args.rounds)]
        for run in ("cold", "warm"):
            figures = {c: [r[run][c] for r in rounds] for c in COLUMNS}
            rows.append({"model": model, "run": run, "rounds": args.rounds,
                         "min": {c: min(v) for c, v in figures.items()},
                         "median": {c: statistics.median(v) for c, v in figures.items()}})
    if args.json:
        print(json.dumps({"mesh": args.mesh, "rows": rows}, indent=2))
        return 0
    print(f"shardverify plan zoo:NAME --mesh {args.mesh}: CPU seconds per phase, min / median over "
          f"{args.rounds} round(s) (a fresh process each: cold, then warm in the same process)")
    print(f"{'model':<8} {'run':<5} " + " ".join(f"{c:>13}" for c in COLUMNS))
    for row in rows:
        print(f"{row['model']:<8} {row['run']:<5} " + " ".join(
            f"{row['min'][c]:>6.2f}/{row['median'][c]:<6.2f}" for c in COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
