"""What a CPU-second is worth on this machine now: a fixed workload with no project code in it.

This machine is shared: the suite took 2,986 and 2,680 CPU-seconds in two CI runs a commit apart,
the commit changing no test's work, as the host's other work slowed each instruction. A figure
measured alone cannot say whether the code or the machine changed; set against this floor,
measured in the same run, it can. CI runs it before and after the suite and states the suite's
CPU time in floor rounds.

A round is three parts, each timed in CPU seconds and each like a part of what the suite does:

  python  interpreter work: small tuples, dicts and strings, in a loop of fixed length
  torch   small tensor ops on one thread, forward and backward (a matmul, a GELU, reductions)
  start   a fresh interpreter importing torch (a child process: its CPU time, waited for)

The figures are the minimum and the median over ``--rounds`` rounds::

    .venv/bin/python benchmarks/bench_floor.py              # 5 rounds
    .venv/bin/python benchmarks/bench_floor.py --quick      # 1 round (CI's smoke run)
    .venv/bin/python benchmarks/bench_floor.py --total      # only the total's minimum, for a script
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

PARTS = ("python", "torch", "start")
PYTHON_STEPS = 2_000_000
TORCH_STEPS = 1_600


def python_part(steps: int = PYTHON_STEPS) -> int:
    """Interpreter work of fixed length: keys built, looked up and filled, names formatted."""
    table: dict = {}
    for i in range(steps):
        key = ("layout", i % 97, (i * 7) % 13)
        entry = table.get(key)
        if entry is None:
            entry = table[key] = [f"S{i % 4}R{i % 3}", 0]
        entry[1] += len(entry[0])
    return sum(value[1] for value in table.values())


def torch_part(steps: int = TORCH_STEPS) -> float:
    """Small ops on one thread, forward and backward, on values drawn from a fixed seed."""
    import torch

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=generator, requires_grad=True)
    w = torch.randn(64, 64, generator=generator, requires_grad=True)
    total = 0.0
    for _ in range(steps):
        y = torch.nn.functional.gelu(x @ w).sum(dim=0)
        y.sum().backward()
        total += float(x.grad.abs().max())
        x.grad = w.grad = None
    return total


def start_part() -> None:
    """A fresh interpreter that imports torch and exits; its CPU time is the child's."""
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=600)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_round() -> dict[str, float]:
    """CPU seconds of each part of one round."""
    figures = {}
    began = time.process_time()
    python_part()
    figures["python"] = time.process_time() - began
    began = time.process_time()
    torch_part()
    figures["torch"] = time.process_time() - began
    began = _children_cpu()
    start_part()
    figures["start"] = _children_cpu() - began
    figures["total"] = sum(figures[part] for part in PARTS)
    return figures


def measure(rounds: int) -> dict[str, dict[str, float]]:
    """Min and median CPU seconds of each part and of the total over ``rounds`` rounds (after
    one untimed round: torch's first import and first calls are not the floor)."""
    import torch

    torch.set_num_threads(1)
    one_round()
    taken = [one_round() for _ in range(rounds)]
    return {name: {"min": min(r[name] for r in taken), "median": statistics.median(r[name] for r in taken)}
            for name in (*PARTS, "total")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--quick", action="store_true", help="CI's smoke run: 1 round")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--total", action="store_true",
                        help="print only the total's minimum over the rounds, in CPU seconds (for a script)")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 1
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    figures = measure(args.rounds)
    if args.total:
        print(f"{figures['total']['min']:.3f}")
    elif args.json:
        print(json.dumps({"rounds": args.rounds, "load_average": list(os.getloadavg()), "cpu_seconds": figures}))
    else:
        print(f"a floor round, no project code: CPU seconds, min / median over {args.rounds} round(s); "
              f"load average {os.getloadavg()[0]:.2f}")
        for name in (*PARTS, "total"):
            print(f"  {name:7s} {figures[name]['min']:.3f} / {figures[name]['median']:.3f}")
    if not figures["total"]["min"] > 0:
        print("bench_floor: a round took no CPU time: this machine's clock cannot time it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
