"""Backends run one SPMD function on every rank of a mesh (see ``base.py`` for the contract)."""

from __future__ import annotations

from typing import Any

from shardverify.backends.base import Backend, Communicator, CommunicatorBase, RankResult
from shardverify.backends.registry import BackendKind, backend_kind, backend_names, register
from shardverify.backends.simulated import SimulatedBackend, SimulatedCommunicator
from shardverify.sharding.mesh import DeviceMesh


def get_backend(name: str, mesh: DeviceMesh, **kwargs: Any) -> Backend:
    """Build a backend by its registered name (``backends/registry.py`` describes each kind;
    ``kwargs`` go to its constructor). An unknown name is a BackendError listing the known ones."""
    return backend_kind(name).build(mesh, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "BACKEND_NAMES":   # read at use: a kind registered later is a name too
        return backend_names()
    # the process backends pull in multiprocessing machinery; import them on first use
    if name in ("ProcessBackend", "ProcessCommunicator", "TorchrunBackend"):
        from shardverify.backends import distributed, process, torchrun

        for module in (process, distributed, torchrun):
            if hasattr(module, name):
                return getattr(module, name)
    raise AttributeError(f"module 'shardverify.backends' has no attribute {name!r}")


__all__ = [
    "BACKEND_NAMES", "Backend", "BackendKind", "Communicator", "CommunicatorBase", "ProcessBackend", "ProcessCommunicator",
    "RankResult", "SimulatedBackend", "SimulatedCommunicator", "TorchrunBackend", "backend_kind", "backend_names",
    "get_backend", "register",
]
