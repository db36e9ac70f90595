"""The backends of one pytest process, cached per (kind, mesh shape), a bounded number of
process pools kept, all closed at session end; and which kind a test gets."""

from __future__ import annotations

import atexit
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from shardverify.backends import registry
from shardverify.errors import InvalidArgument
from shardverify.pytest_plugin.placement import plan_process_backend, worker_gpu_slice
from shardverify.pytest_plugin.settings import BACKEND_KINDS, ENV_FLAG, Settings
from shardverify.sharding.mesh import DeviceMesh

if TYPE_CHECKING:
    from shardverify.backends.base import Backend

__all__ = ["MAX_PROCESS_POOLS", "IDLE_SECONDS", "BackendPool", "resolve_kind"]

# Process pools kept alive per xdist worker; the least recently used is closed beyond this,
# so a suite touching many mesh shapes holds a bounded number of processes (one per rank,
# about 70 MB each). The shipped specs use six shapes ((4,), (2, 2), (2, 3), (2, 2, 2), (1, 4),
# (2,)): with four, the process tests restarted 56 pools (3-5 s each, 4 min 51 s wall); with
# six, 23 (4 min 7 s), at a peak of 8.8 GB used on the 24 GB machine with four workers.
MAX_PROCESS_POOLS = 6

# A process pool no test has held this long is closed as the next test begins. An idle gloo
# rank is not idle: each of its process groups has a transport thread that wakes every 10 ms,
# 1-2.5 ms of CPU a second per group (a (2, 2, 2) pool, 7 groups a rank: 50 ms a second; (2, 3):
# 19; (4,): 11), while starting and closing a pool from the forkserver costs 0.1-0.5 CPU-s. So
# a pool idle for 20 s has cost about what starting it again does. Kept for the session, the
# pools of the first (slow) tests polled for the rest of it.
IDLE_SECONDS = 20.0


class BackendPool:
    """The backends of one pytest process (one xdist worker), cached per (kind, mesh shape)
    and all closed at session end -- by the session fixture, the session-finish hook, and
    atexit as a last resort (Ctrl-C, internal errors)."""

    def __init__(self, settings: Settings,
                 factory: Callable[..., Backend] | None = None) -> None:
        self.settings = settings
        self._factory = factory
        self._backends: OrderedDict[tuple[str, tuple[int, ...]], Backend] = OrderedDict()
        self._used: dict[tuple[str, tuple[int, ...]], float] = {}   # key -> when last handed out or held
        self._in_test: set[tuple[str, tuple[int, ...]]] = set()   # handed out since the test began
        atexit.register(self.close_all)

    def get(self, mesh: DeviceMesh, kind: str) -> Backend:
        """The cached backend of this kind for `mesh.shape`, built on first use."""
        __tracebackhide__ = True
        key = (kind, mesh.shape)
        self._in_test.add(key)
        self._used[key] = time.monotonic()
        if key in self._backends:
            self._backends.move_to_end(key)
            return self._backends[key]
        backend = self._build(mesh, kind)
        self._backends[key] = backend
        if registry.backend_kind(kind).processes:
            self._evict_process_pools()
        return backend

    def _build(self, mesh: DeviceMesh, kind: str) -> Backend:
        build = self._factory
        if build is None:
            from shardverify.backends import get_backend as build
        timeout = self.settings.timeout
        if not registry.backend_kind(kind).processes:   # threads of this process
            return build(kind, mesh, timeout=timeout)
        count = registry.visible_gpus() if self.settings.device != "cpu" else 0
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
        gpus = worker_gpu_slice(count, worker, workers)
        plan = plan_process_backend(mesh.size, gpus, count, self.settings.device,
                                    int(workers) if worker else 1)
        # other xdist workers' pools share the CPUs: the OS must be free to balance them all
        keep_cpus = not worker or int(workers) == 1
        if plan.backend == "nccl":
            return build("nccl", mesh, device_ids=plan.device_ids, timeout=timeout, keep_cpus=keep_cpus)
        return build("gloo", mesh, timeout=timeout, keep_cpus=keep_cpus)

    def _evict_process_pools(self) -> None:
        process_keys = [k for k in self._backends if registry.backend_kind(k[0]).processes]
        for key in process_keys[:-MAX_PROCESS_POOLS]:
            self._backends.pop(key).close()

    def test_began(self) -> None:
        """Close the process pools no test has held for :data:`IDLE_SECONDS` (between tests:
        none is in use)."""
        now = time.monotonic()
        for key in [k for k in self._backends if registry.backend_kind(k[0]).processes
                    and now - self._used[k] > IDLE_SECONDS]:
            self._backends.pop(key).close()

    def test_ended(self) -> None:
        """The backends handed out in the test that ended were in use until now."""
        now = time.monotonic()
        self._used.update(dict.fromkeys(self._in_test, now))
        self._in_test.clear()

    def close_all(self) -> None:
        """Close every backend; idempotent, and one failing close does not stop the rest."""
        errors = []
        while self._backends:
            _, backend = self._backends.popitem()
            try:
                backend.close()
            except Exception as exc:  # noqa: BLE001 -- report after closing the others
                errors.append(exc)
        atexit.unregister(self.close_all)
        if errors:
            raise errors[0]


def resolve_kind(kind: str | None, is_dist: bool, settings: Settings, nodeid: str) -> str:
    """dist tests always get processes; other tests the --sv-backend default, and may ask
    for "process" explicitly only if they are marked dist (so AUTO_PARALLEL gates them)."""
    if kind is None:
        return "process" if is_dist else settings.backend
    if kind not in BACKEND_KINDS:
        raise InvalidArgument(f"kind={kind!r}: expected one of {BACKEND_KINDS} or None "
                              f"(the --sv-backend default, {settings.backend!r})")
    if registry.backend_kind(kind).processes and not is_dist and settings.backend != kind:
        raise InvalidArgument(f"{nodeid} asks for the {kind} backend but is not marked "
                              f"@pytest.mark.dist; mark it so that {ENV_FLAG} gates it")
    return kind

