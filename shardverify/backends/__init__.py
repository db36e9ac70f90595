"""Backends run one SPMD function on every rank of a mesh (see ``base.py`` for the contract)."""

from __future__ import annotations

from typing import Any

from shardverify.backends.base import Backend, Communicator, CommunicatorBase, RankResult
from shardverify.backends.simulated import SimulatedBackend, SimulatedCommunicator
from shardverify.errors import BackendError
from shardverify.sharding.mesh import DeviceMesh

#: names accepted by ``get_backend``
BACKEND_NAMES = ("simulated", "process", "gloo", "nccl", "torchrun")


def get_backend(name: str, mesh: DeviceMesh, **kwargs: Any) -> Backend:
    """Build a backend by name.

    ``simulated``: threads in this process.  ``gloo`` / ``nccl``: a persistent worker pool
    with that torch.distributed backend.  ``process``: the pool with nccl when there is a
    GPU per rank (or ``device_ids`` are given), gloo otherwise.  ``torchrun``: this process
    is one rank of a world started by torchrun.  ``kwargs`` go to the constructor.
    """
    if name == "simulated":
        return SimulatedBackend(mesh, **kwargs)
    if name in ("process", "gloo", "nccl"):
        from shardverify.backends.process import ProcessBackend, default_dist_backend

        dist_backend = default_dist_backend(mesh, kwargs.get("device_ids")) if name == "process" else name
        return ProcessBackend(mesh, backend=dist_backend, **kwargs)
    if name == "torchrun":
        from shardverify.backends.torchrun import TorchrunBackend

        return TorchrunBackend(mesh, **kwargs)
    raise BackendError(f"unknown backend {name!r}; expected one of {BACKEND_NAMES}")


def __getattr__(name: str) -> Any:
    # the process backends pull in multiprocessing machinery; import them on first use
    if name in ("ProcessBackend", "ProcessCommunicator", "TorchrunBackend"):
        from shardverify.backends import distributed, process, torchrun

        for module in (process, distributed, torchrun):
            if hasattr(module, name):
                return getattr(module, name)
    raise AttributeError(f"module 'shardverify.backends' has no attribute {name!r}")


__all__ = [
    "BACKEND_NAMES", "Backend", "Communicator", "CommunicatorBase", "ProcessBackend", "ProcessCommunicator",
    "RankResult", "SimulatedBackend", "SimulatedCommunicator", "TorchrunBackend", "get_backend",
]
