"""Peak memory of one plan check, per parameter of the model checked.

Builds an MLP of four 1024x1024 linear layers (4.2 M parameters) and, in a fresh process per
figure so that peaks do not mix, runs ``verify_plan`` on the simulated backend (every rank a
thread of this process) on a (2, 2) mesh, under the replicated plan, a data-parallel plan and a
plan sharding every weight, after a warm-up check of a tiny model (so one-time imports are not
counted). Prints the peak resident memory the check added over the model alone, in bytes per
parameter, beside the model's own float32 size (4 B per parameter), and the machine's load; each
plan twice: in a process that sets itself up to check as `shardverify plan` and the test session
do (``tune_for_checking``: large freed blocks go back to the OS), and in a plain program calling
the library, whose C allocator keeps freed blocks in each rank thread's heap::

    .venv/bin/python benchmarks/bench_plan_memory.py            # 4 layers of 1024
    .venv/bin/python benchmarks/bench_plan_memory.py --width 2048
    .venv/bin/python benchmarks/bench_plan_memory.py --gpt2-small   # HF GPT-2 small (124 M), torch.export, minutes
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

PLANS = ("replicated", "data_parallel", "shard_weights")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _gpt2_small():
    """HF transformers' GPT-2 small (124 M parameters, random weights) and a batch of 4 x 16 ids."""
    import torch
    import transformers

    config = transformers.GPT2Config(attn_implementation="sdpa", use_cache=False)
    return transformers.GPT2LMHeadModel(config).eval(), (torch.randint(0, config.vocab_size, (4, 16)),)


def child(plan: str, width: int, layers: int, tuned: bool, gpt2_small: bool = False) -> None:
    import torch

    from shardverify import verify_plan
    from shardverify.backends.gc_policy import tune_for_checking

    if tuned:
        tune_for_checking()

    # warm-up: the first check imports and initialises torch machinery (about 80 MB, whatever
    # the model) that is not the check's cost per parameter
    tiny = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    verify_plan(tiny, (torch.randn(4, 8),), (2, 2), None, data_parallel=True)
    verify_plan(tiny, (torch.randn(4, 8),), (2, 2), None, shard_weights=True)
    torch.manual_seed(0)
    if gpt2_small:
        model, inputs = _gpt2_small()
    else:
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        inputs = (torch.randn(8, width),)
    params = sum(p.numel() for p in model.parameters())
    before = _rss_bytes()
    kwargs = {"data_parallel": plan == "data_parallel", "shard_weights": plan == "shard_weights"}
    chosen = {} if plan == "replicated" else None       # {}: every node replicated
    result = verify_plan(model, inputs, (2, 2), chosen, capture="export" if gpt2_small else "fx",
                         timeout=1800 if gpt2_small else None, **kwargs)
    print(json.dumps({"plan": plan, "params": params, "passed": result.passed,
                      "added": max(0, _peak_bytes() - before), "peak": _peak_bytes()}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--child", choices=PLANS, help=argparse.SUPPRESS)
    parser.add_argument("--gpt2-small", action="store_true",
                        help="HF GPT-2 small (124 M parameters; the models extra) in place of the MLP, in a "
                             "checking process only")
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="CI's smoke run: 2 layers of 256, the plan sharding every weight, the checking process only")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.layers = 256, 2
    if args.child:
        child(args.child, args.width, args.layers, not args.plain, args.gpt2_small)
        return 0
    print(f"load average: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"{'plan':<16}{'process':<18}{'parameters':>12}{'added MiB':>11}{'B/param':>9}{'vs float32 model':>18}"
          f"{'process peak MiB':>18}  verdict")
    for plan in ("shard_weights",) if args.quick else PLANS:
        kinds = (("checking", []),) if args.gpt2_small or args.quick else (("checking", []), ("plain library", ["--plain"]))
        for process, extra in kinds:
            out = subprocess.run([sys.executable, __file__, "--child", plan, "--width", str(args.width),
                                  "--layers", str(args.layers), *extra, *(["--gpt2-small"] if args.gpt2_small else [])],
                                 capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            per = row["added"] / row["params"]
            print(f"{plan:<16}{process:<18}{row['params']:>12,}{row['added'] / 2**20:>11.0f}{per:>9.1f}"
                  f"{per / 4:>17.1f}x{row['peak'] / 2**20:>18.0f}  {'PASS' if row['passed'] else 'FAIL'}")
    print(f"load average: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
