"""Per-axis alpha (latency) and beta (seconds per byte) of a mesh, measured on a real backend.

``shardverify calibrate`` times all-reduces and all-gathers of a range of sizes over each mesh
axis on the worker pool (raw ``torch.distributed`` calls on the axis' process groups, every group
of the axis at once, as a strategy's collectives run), fits the mesh's own alpha-beta model
(``DeviceMesh.collective_cost``) by least squares on relative error; the result goes to the
file :mod:`shardverify.sharding.calibration_file` writes and :meth:`DeviceMesh.calibrated` loads.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardverify.errors import MeshError
from shardverify.sharding.calibration_file import (DEFAULT_PATH, ENV_VAR, AxisFit, calibration_path,
                                                   load_calibration, save_calibration)
from shardverify.sharding.mesh import DeviceMesh

__all__ = ["ENV_VAR", "DEFAULT_PATH", "Sample", "AxisFit", "calibration_path", "fit_axis", "fit_mesh",
           "save_calibration", "load_calibration", "measure", "time_collectives", "time_traffic",
           "replay_times", "spearman", "rank_multiply_rate", "measure_rate"]

#: collectives timed for the fit
KINDS = ("all_reduce", "all_gather")


@dataclass(frozen=True)
class Sample:
    """One timing: ``kind`` over mesh ``axis`` with ``payload`` bytes per rank took ``seconds``."""

    axis: int
    kind: str
    payload: int
    seconds: float


# ------------------------------------------------------------------------------------ fitting

def _coefficients(mesh_shape: tuple[int, ...], sample: Sample) -> tuple[float, float]:
    """The model's seconds per unit alpha and per unit beta for this sample (from the mesh's own
    cost functions, so the fit and the pricing can never disagree on the formula)."""
    ndim = len(mesh_shape)
    unit = [0.0] * ndim
    unit[sample.axis] = 1.0
    zeros = (0.0,) * ndim
    c_alpha = DeviceMesh(mesh_shape, alpha=unit, beta=zeros).collective_cost(sample.kind, sample.payload, (sample.axis,))
    c_beta = DeviceMesh(mesh_shape, alpha=zeros, beta=unit).collective_cost(sample.kind, sample.payload, (sample.axis,))
    return c_alpha, c_beta


def _solve(rows: list[tuple[float, float, float]], use: tuple[bool, bool]) -> tuple[float, float]:
    """Least squares of ``t ~ a * ca + b * cb`` on relative error (rows scaled by 1/t), with the
    parameters not in ``use`` held at zero."""
    scaled = [(ca / t, cb / t) for ca, cb, t in rows]
    saa = sum(x * x for x, _ in scaled)
    sbb = sum(y * y for _, y in scaled)
    sab = sum(x * y for x, y in scaled)
    sa, sb = sum(x for x, _ in scaled), sum(y for _, y in scaled)
    if use == (True, True):
        det = saa * sbb - sab * sab
        if det > 1e-12 * saa * sbb:
            return (sa * sbb - sb * sab) / det, (sb * saa - sa * sab) / det
        use = (True, False)
    if use == (True, False):
        return (sa / saa if saa else 0.0), 0.0
    return 0.0, (sb / sbb if sbb else 0.0)


def fit_axis(mesh_shape: Sequence[int], samples: Sequence[Sample], axis: int) -> AxisFit:
    """Alpha and beta of ``axis`` (both >= 0) from its samples."""
    mesh_shape = tuple(mesh_shape)
    rows = [(*_coefficients(mesh_shape, s), s.seconds) for s in samples if s.axis == axis and s.seconds > 0]
    rows = [r for r in rows if r[0] > 0 or r[1] > 0]
    if len(rows) < 2:
        raise MeshError(f"calibration of mesh axis {axis} of {mesh_shape} needs at least 2 timings of a "
                        f"group larger than one rank, got {len(rows)}")
    alpha, beta = _solve(rows, (True, True))
    if alpha < 0 or beta < 0:   # the best non-negative fit has one of them at zero
        candidates = [_solve(rows, (True, False)), _solve(rows, (False, True))]
        alpha, beta = min(candidates, key=lambda ab: _rel_rms(rows, *ab))
    return AxisFit(axis, max(alpha, 0.0), max(beta, 0.0), _rel_rms(rows, alpha, beta), len(rows))


def _rel_rms(rows, alpha: float, beta: float) -> float:
    return math.sqrt(sum(((alpha * ca + beta * cb) / t - 1) ** 2 for ca, cb, t in rows) / len(rows))


def fit_mesh(mesh_shape: Sequence[int], samples: Sequence[Sample]) -> list[AxisFit]:
    """One fit per mesh axis of size > 1 (an axis of size 1 never communicates: alpha = beta = 0)."""
    fits = []
    for axis, size in enumerate(mesh_shape):
        fits.append(fit_axis(mesh_shape, samples, axis) if size > 1 else AxisFit(axis, 0.0, 0.0, 0.0, 0))
    return fits


# ------------------------------------------------------------------------------ measurement

def _sync(comm) -> None:
    if comm.device.type == "cuda":
        torch.cuda.synchronize(comm.device)


def _issue(comm, kind: str, axes: tuple[int, ...], payload: int) -> None:
    """One raw collective of ``payload`` bytes (float32) over ``axes`` on the real process group."""
    import torch.distributed as dist

    pg = comm.process_group(axes)
    n = comm.mesh.axes_size(axes)
    numel = max(payload // 4, 1)
    t = torch.ones(numel, dtype=torch.float32, device=comm.device)
    if kind == "all_reduce":
        dist.all_reduce(t, group=pg)
    elif kind == "all_gather":
        dist.all_gather([torch.empty_like(t) for _ in range(n)], t, group=pg)
    elif kind == "all_to_all":   # equal chunks: a multiple of the group size
        t = torch.ones(max(numel // n, 1) * n, dtype=torch.float32, device=comm.device)
        dist.all_to_all_single(torch.empty_like(t), t, group=pg)
    elif kind == "reduce_scatter":   # as the communicator does on gloo: all-reduce, keep a segment
        dist.all_reduce(t, group=pg)
    else:
        raise MeshError(f"cannot time collective {kind!r}")


def _timed(comm, body, repeats: int, warmup: int) -> float:
    """Median seconds of ``body`` over ``repeats`` runs, all ranks started together by a barrier."""
    import torch.distributed as dist

    for _ in range(warmup):
        body()
    times = []
    for _ in range(repeats):
        dist.barrier()
        _sync(comm)
        start = time.perf_counter()
        body()
        _sync(comm)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_collectives(comm, payloads: tuple[int, ...], repeats: int, warmup: int) -> list[tuple]:
    """SPMD: (axis, kind, payload, median seconds) on this rank for every axis of size > 1."""
    if comm.process_group((0,)) is None:
        raise MeshError("calibration needs a real backend (gloo, nccl): the simulated mesh has no wires")
    found = []
    for axis, size in enumerate(comm.mesh.shape):
        if size == 1:
            continue
        for kind in KINDS:
            for payload in payloads:
                seconds = _timed(comm, lambda: _issue(comm, kind, (axis,), payload), repeats, warmup)
                found.append((axis, kind, payload, seconds))
    return found


def time_traffic(comm, plans: tuple[tuple[tuple[str, tuple[int, ...], int], ...], ...], repeats: int,
                 warmup: int) -> list[float]:
    """SPMD: median seconds of each plan (a sequence of (kind, axes, payload bytes) collectives)."""
    def run(plan):
        return lambda: [_issue(comm, kind, axes, payload) for kind, axes, payload in plan]

    return [_timed(comm, run(plan), repeats, warmup) if plan else 0.0 for plan in plans]


def measure(backend, payloads: Sequence[int], repeats: int = 10, warmup: int = 2) -> list[Sample]:
    """Time the collectives on every rank; a sample's time is the slowest rank's median."""
    per_rank = backend.run(time_collectives, tuple(payloads), repeats, warmup, timeout=600)
    return [Sample(axis, kind, payload, max(rank[i][3] for rank in per_rank))
            for i, (axis, kind, payload, _) in enumerate(per_rank[0])]


def rank_multiply_rate(comm, size: int = 512, repeats: int = 5) -> float:
    """Multiply-adds per second of a float32 matmul on this rank (the median of ``repeats`` runs)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        runs.append(time.perf_counter() - start)
    return size ** 3 / statistics.median(runs)


def measure_rate(backend) -> float:
    """The slowest rank's multiply-adds per second: a step waits for it."""
    return min(backend.run(rank_multiply_rate, timeout=600))


def replay_times(backend, plans: Sequence[Sequence[tuple[str, tuple[int, ...], int]]], repeats: int = 10,
                 warmup: int = 2) -> list[float]:
    """Measured seconds of each plan of collectives (slowest rank's median)."""
    frozen = tuple(tuple((k, tuple(a), int(p)) for k, a, p in plan) for plan in plans)
    per_rank = backend.run(time_traffic, frozen, repeats, warmup, timeout=600)
    return [max(rank[i] for rank in per_rank) for i in range(len(frozen))]


# ---------------------------------------------------------------------------------- ranking

def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson correlation of the tie-averaged ranks)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"spearman needs two equally long sequences of at least 2 values, got {len(xs)} and {len(ys)}")
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else float("nan")
