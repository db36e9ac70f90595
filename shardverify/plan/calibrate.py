"""Measure a backend's alpha-beta link costs and the local multiply rate, so declared plan
costs can be compared with measured step times in the units that hold on that machine."""

from __future__ import annotations

import time

import torch

from shardverify.sharding.mesh import DeviceMesh

__all__ = ["rank_link_seconds", "rank_flop_rate", "calibrated_mesh"]


def rank_link_seconds(comm, numel: int, axes: tuple[int, ...], repeats: int) -> float:
    """Median seconds of one all-reduce of ``numel`` float32 over ``axes`` (after a warm-up)."""
    t = torch.ones(numel)
    times = []
    for _ in range(repeats + 1):
        comm.barrier()
        start = time.perf_counter()
        comm.all_reduce(t, axes, "sum")
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])
    return times[len(times) // 2]


def rank_flop_rate(comm, size: int = 256, repeats: int = 5) -> float:
    """Multiplies per second of a float32 matmul on this rank."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return repeats * size ** 3 / (time.perf_counter() - start)


def calibrated_mesh(backend, repeats: int = 10) -> tuple[DeviceMesh, float]:
    """The backend's mesh with per-axis alpha (small all-reduce) and beta (large all-reduce)
    fitted to the all-reduce cost model ``2 (n-1) (alpha + beta bytes / n)``, and the slowest
    rank's multiply rate."""
    mesh = backend.mesh
    alphas, betas = [], []
    for axis in range(mesh.ndim):
        n = mesh.shape[axis]
        if n == 1:
            alphas.append(0.0)
            betas.append(0.0)
            continue
        small = max(backend.run(rank_link_seconds, 1, (axis,), repeats))
        big_bytes = 4 * 2 ** 20
        big = max(backend.run(rank_link_seconds, big_bytes // 4, (axis,), repeats))
        alpha = small / (2 * (n - 1))
        beta = max(big / (2 * (n - 1)) - alpha, 0.0) * n / big_bytes
        alphas.append(alpha)
        betas.append(beta)
    rate = min(backend.run(rank_flop_rate))
    return DeviceMesh(mesh.shape, alpha=tuple(alphas), beta=tuple(betas)), rate
