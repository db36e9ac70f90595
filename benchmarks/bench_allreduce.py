"""Ring and naive all-reduce (on send/recv) against the torch.distributed builtin.

Runs on gloo processes (ProcessBackend, metadata checks off so only the payload moves) and
prints, per message size, the median time of each algorithm, its algorithm bandwidth
(bytes / time) and its time relative to the builtin measured in the same run::

    .venv/bin/python benchmarks/bench_allreduce.py            # 4 KiB .. 64 MiB, 4 ranks
    .venv/bin/python benchmarks/bench_allreduce.py --quick    # a few sizes, few repeats

Every repeat starts after a barrier and its time is the slowest rank's, which is when
the all-reduce is complete everywhere. Results are checked against the builtin's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from shardverify.backends.process import ProcessBackend
from shardverify.features.algorithms.implementations import naive_all_reduce, ring_all_reduce
from shardverify.sharding.mesh import DeviceMesh

ALGORITHMS = ("builtin", "ring", "naive")
FULL_SIZES = tuple(4096 * 4 ** i for i in range(8))          # 4 KiB .. 64 MiB
QUICK_SIZES = (4096, 262144, 4 * 2 ** 20)


def _builtin(comm, t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    out = t.clone()
    dist.all_reduce(out, group=comm.process_group((0,)))
    return out


def _run_algorithm(comm, name: str, t: torch.Tensor) -> torch.Tensor:
    if name == "builtin":
        return _builtin(comm, t)
    if name == "ring":
        return ring_all_reduce(comm, t, (0,))
    return naive_all_reduce(comm, t, (0,))


def time_rank(comm, name: str, nbytes: int, repeats: int, warmup: int) -> tuple[list[float], float]:
    """This rank's seconds per repeat, and the max error against the builtin's result."""
    torch.set_num_threads(1)
    t = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(comm.rank))
    with torch.no_grad():
        error = (_run_algorithm(comm, name, t) - _builtin(comm, t)).abs().max().item()
        for _ in range(warmup):
            _run_algorithm(comm, name, t)
        times = []
        for _ in range(repeats):
            comm.barrier()
            start = time.perf_counter()
            _run_algorithm(comm, name, t)
            times.append(time.perf_counter() - start)
    return times, error


def _repeats(nbytes: int, quick: bool) -> tuple[int, int]:
    if quick:
        return (5, 1) if nbytes <= 2 ** 20 else (2, 1)
    if nbytes <= 2 ** 20:
        return 20, 3
    return (5, 1) if nbytes <= 16 * 2 ** 20 else (3, 1)


def _size(nbytes: int) -> str:
    return f"{nbytes // 2 ** 20} MiB" if nbytes >= 2 ** 20 else f"{nbytes // 1024} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three sizes, few repeats")
    parser.add_argument("--ranks", type=int, default=4, help="gloo processes (default 4)")
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error(f"--ranks must be >= 2, got {args.ranks}")
    sizes = QUICK_SIZES if args.quick else FULL_SIZES

    backend = ProcessBackend(DeviceMesh((args.ranks,)), backend="gloo", check_metadata=False, timeout=600.0)
    try:
        print(f"all-reduce (sum, float32) on {args.ranks} gloo processes, torch {torch.__version__}")
        header = f"{'size':>8} | " + " | ".join(f"{name:>8} ms  {'GB/s':>6}" for name in ALGORITHMS) + \
            " | ring/builtin  naive/builtin  naive/ring"
        print(header)
        print("-" * len(header))
        for nbytes in sizes:
            repeats, warmup = _repeats(nbytes, args.quick)
            medians, worst = {}, 0.0
            for name in ALGORITHMS:
                per_rank = backend.run(time_rank, name, nbytes, repeats, warmup)
                slowest = [max(ts[i] for ts, _ in per_rank) for i in range(repeats)]
                medians[name] = statistics.median(slowest)
                worst = max(worst, *(err for _, err in per_rank))
            cells = " | ".join(f"{medians[n] * 1e3:>11.3f}  {nbytes / medians[n] / 1e9:>6.3f}" for n in ALGORITHMS)
            print(f"{_size(nbytes):>8} | {cells} | {medians['ring'] / medians['builtin']:>12.2f}  "
                  f"{medians['naive'] / medians['builtin']:>13.2f}  {medians['naive'] / medians['ring']:>10.2f}"
                  + (f"  (max |err| vs builtin {worst:.2g})" if worst > 1e-3 else ""), flush=True)
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
