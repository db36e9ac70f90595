"""A backend for worlds started by ``torchrun`` (one or many nodes, env:// rendezvous).

This process is one rank; ``run`` executes the check here and shares every rank's outcome
through the world's key-value store, so each rank (rank 0 reports) gets the full result
list or the same failure, within a per-run timeout that names the ranks that never
answered.  The rank side is the same ``ProcessCommunicator`` the worker pool uses.

A torchrun world cannot be rebuilt from inside: after ``RankTimeout`` the job should exit
and let torchrun restart it (a rank that dies is handled by torchrun itself).
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardverify.backends.base import ClosingBackend, RankResult, check_fn, check_timeout
from shardverify.backends.distributed import ProcessCommunicator, build_groups
from shardverify.backends.registry import choose_dist, visible_gpus
from shardverify.errors import BackendError, RankTimeout
from shardverify.sharding.mesh import DeviceMesh

_POLL = 0.01


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise BackendError(f"TorchrunBackend needs ${name}; start this program with torchrun "
                           f"(e.g. torchrun --nproc-per-node=4 your_script.py)")
    try:
        return int(value)
    except ValueError:
        raise BackendError(f"${name} must be an integer, got {value!r}") from None


class TorchrunBackend(ClosingBackend):
    """This process as rank ``$RANK`` of a ``$WORLD_SIZE``-rank world laid out as ``mesh``.

    ``backend`` defaults to nccl when CUDA is available (rank on ``cuda:$LOCAL_RANK``),
    gloo otherwise.  Initialises the default process group unless already initialised.
    """

    _instances = 0   # every rank builds its backends in the same order, so ids agree

    def __init__(self, mesh: DeviceMesh, backend: str | None = None, timeout: float = 30.0,
                 *, check_metadata: bool = True) -> None:
        if not isinstance(mesh, DeviceMesh):
            raise BackendError(f"TorchrunBackend needs a DeviceMesh, got {mesh!r}")
        self.mesh = mesh
        self.timeout = check_timeout(timeout, 30.0)
        self.rank, world, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
        if world != mesh.size:
            raise BackendError(f"WORLD_SIZE={world} but mesh {mesh.shape} has {mesh.size} ranks")
        # this rank needs one GPU of its own host for NCCL (the registry's one rule)
        self.backend = backend or choose_dist(1, visible_gpus())
        if self.backend not in ("gloo", "nccl"):
            raise BackendError(f"TorchrunBackend backend must be 'gloo' or 'nccl', got {self.backend!r}")
        self.device = torch.device(f"cuda:{local_rank}") if self.backend == "nccl" else torch.device("cpu")
        began = time.perf_counter()
        self._owns_world = not dist.is_initialized()
        if self._owns_world:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(self.backend, init_method="env://",
                                    timeout=datetime.timedelta(seconds=max(self.timeout, 60.0)))
        elif dist.get_world_size() != mesh.size:
            raise BackendError(f"the initialised world has {dist.get_world_size()} ranks, mesh {mesh.shape} "
                               f"needs {mesh.size}")
        self._groups = build_groups(mesh, self.rank)
        self._store = dist.PrefixStore("shardverify", dist.distributed_c10d._get_default_store())
        self.check_metadata = check_metadata
        self.startup_seconds = time.perf_counter() - began
        self._runs = 0
        self._closed = False
        TorchrunBackend._instances += 1
        self._id = TorchrunBackend._instances   # keeps store keys of two backends apart

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Run ``fn(comm, *args)`` here and return every rank's value (on every rank)."""
        check_fn(fn)
        timeout = check_timeout(timeout, self.timeout)
        if self._closed:
            raise BackendError("this TorchrunBackend is closed")
        self._runs += 1
        deadline = time.monotonic() + timeout
        comm = ProcessCommunicator(self.mesh, self.rank, self.device, self._groups,
                                   check_metadata=self.check_metadata,
                                   native_reduce_scatter=self.backend == "nccl")
        try:
            mine = RankResult(self.rank, True, fn(comm, *args))
            data = pickle.dumps(mine)
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks
            data = pickle.dumps(RankResult.failure(self.rank, exc))
        prefix = f"backend{self._id}/run{self._runs}/"
        self._store.set(f"{prefix}{self.rank}", data)
        keys = [f"{prefix}{r}" for r in self.mesh.ranks]
        while not self._store.check(keys):
            if time.monotonic() > deadline:
                missing = tuple(r for r, key in enumerate(keys) if not self._store.check([key]))
                raise RankTimeout(missing, timeout, getattr(fn, "__qualname__", repr(fn)))
            time.sleep(_POLL)
        results: list[RankResult] = [pickle.loads(self._store.get(key)) for key in keys]
        if self._store.add(f"{prefix}read", 1) == self.mesh.size:   # the last reader cleans up
            for key in keys:
                self._store.delete_key(key)
        failures = [r for r in results if not r.ok]
        if failures:
            raise failures[0].error()
        return [r.value for r in results]

    def close(self) -> None:
        """Destroy the process group if this backend created it."""
        if not self._closed and self._owns_world and dist.is_initialized():
            dist.destroy_process_group()
        self._closed = True


__all__ = ["TorchrunBackend"]
