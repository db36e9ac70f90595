"""Where a process pool runs under pytest-xdist: each worker's disjoint slice of the GPUs, NCCL
when the slice has one GPU per rank (else gloo on CPU, or a skip under --sv-device cuda), and
each worker's share of torch's intra-op threads."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shardverify.backends import registry
from shardverify.backends.cpus import thread_share, usable_cpus
from shardverify.errors import InvalidArgument
from shardverify.pytest_plugin.settings import DEVICE_POLICIES, parse_choice

__all__ = ["ProcessPlan", "NotEnoughDevices", "worker_gpu_slice", "xdist_identity", "THREAD_VARIABLES",
           "worker_threads", "auto_workers", "plan_process_backend"]

@dataclass(frozen=True)
class ProcessPlan:
    """Where a process pool runs: gloo on CPU, or NCCL on these (logical) CUDA devices."""

    backend: str                          # "gloo" | "nccl"
    device_ids: tuple[int, ...] | None    # one GPU per rank for nccl; None on CPU


class NotEnoughDevices(InvalidArgument):
    """--sv-device cuda asked for GPUs this xdist worker does not have (the test skips)."""


def worker_gpu_slice(device_count: int, worker: str | None,
                     worker_count: str | None) -> tuple[int, ...]:
    """The GPUs owned by this xdist worker: worker k of n gets the k-th of n disjoint, equal
    slices, so no two workers' pools ever share a device. Outside xdist: every GPU."""
    if device_count < 0:
        raise InvalidArgument(f"device_count={device_count!r} must be >= 0")
    identity = xdist_identity(worker, worker_count)
    if identity is None:
        return tuple(range(device_count))
    index, count = identity
    per_worker = device_count // count
    return tuple(range(index * per_worker, (index + 1) * per_worker))


def xdist_identity(worker: str | None, worker_count: str | None) -> tuple[int, int] | None:
    """(k, n) for xdist worker 'gw<k>' of n, from PYTEST_XDIST_WORKER and
    PYTEST_XDIST_WORKER_COUNT; None outside xdist."""
    if not worker:
        return None
    if not worker.startswith("gw") or not worker[2:].isdigit():
        raise InvalidArgument(f"PYTEST_XDIST_WORKER={worker!r}: expected 'gw<k>', e.g. 'gw0'")
    if not (worker_count or "").isdigit() or int(worker_count) < 1:  # type: ignore[arg-type]
        raise InvalidArgument(f"PYTEST_XDIST_WORKER_COUNT={worker_count!r}: expected a positive "
                              f"integer alongside PYTEST_XDIST_WORKER={worker!r}")
    index, count = int(worker[2:]), int(worker_count)  # type: ignore[arg-type]
    if index >= count:
        raise InvalidArgument(f"PYTEST_XDIST_WORKER={worker!r} is outside "
                              f"PYTEST_XDIST_WORKER_COUNT={count}")
    return index, count


#: where a user sets the intra-op thread count themselves; the plugin then leaves it alone
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def worker_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """torch's intra-op threads for this xdist worker: its share of the CPUs among the
    workers (see shardverify.backends.cpus.thread_share). None outside xdist, or where the
    environment sets a thread count (THREAD_VARIABLES): the user's choice stands."""
    identity = xdist_identity(environ.get("PYTEST_XDIST_WORKER"), environ.get("PYTEST_XDIST_WORKER_COUNT"))
    if identity is None or any(environ.get(name) for name in THREAD_VARIABLES):
        return None
    return thread_share(identity[1])


#: pytest-xdist's own setting of the ``-n auto`` count, which stands where it is set
AUTO_WORKERS_VARIABLE = "PYTEST_XDIST_AUTO_NUM_WORKERS"


def auto_workers(environ: Mapping[str, str] = os.environ) -> int | None:
    """The xdist workers of ``pytest -n auto``: one per CPU this process may use, as ``verify
    --jobs auto`` runs one process per CPU (None where AUTO_WORKERS_VARIABLE sets the count:
    pytest-xdist reads it). More workers than CPUs buy nothing here: every worker imports torch
    and collects all 919 test modules, starts its own forkserver and process pools, and the
    workers then take turns on the CPUs. The 1,090 generated tests of every eighth spec ran in
    235 and 239 s under ``-n 4`` on 2 cores (459 and 469 CPU-s), in 152 and 170 s under ``-n 2``
    (295 and 330 CPU-s), alternating."""
    if environ.get(AUTO_WORKERS_VARIABLE):
        return None
    return len(usable_cpus())


def plan_process_backend(mesh_size: int, gpus: tuple[int, ...], device_count: int,
                         policy: str, workers: int = 1) -> ProcessPlan:
    """NCCL when this worker's GPU slice has one GPU per rank; otherwise gloo on CPU
    ("auto"), or NotEnoughDevices ("cuda"). "cpu" always uses gloo."""
    parse_choice(policy, DEVICE_POLICIES, "sv_device")
    if registry.choose_dist(mesh_size, len(gpus), policy) == "nccl":
        return ProcessPlan("nccl", tuple(gpus[:mesh_size]))
    if policy == "cuda":
        among = f" shared among {workers} xdist workers" if workers > 1 else ""
        raise NotEnoughDevices(
            f"a mesh of {mesh_size} ranks needs {mesh_size} GPUs, but this worker has "
            f"{len(gpus)} (of {device_count} visible{among}); use fewer xdist workers or "
            f"--sv-device auto to fall back to gloo on CPU")
    return ProcessPlan("gloo", None)

