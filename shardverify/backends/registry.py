"""The one description of every backend kind: its name, how it is built, which torch.distributed
backend (and so which device) it uses, whose mesh size it runs, and which process reports.

Why: the CLI's choices and help, the pytest plugin, `calibrate`, `plan` and `get_backend` all read
this table, so a new backend kind is one module (its Backend class) plus one ``register`` call, and
a bad name is refused before any work. NCCL-or-gloo is decided here only (``choose_dist``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardverify.errors import BackendError

if TYPE_CHECKING:
    from shardverify.backends.base import Backend
    from shardverify.sharding.mesh import DeviceMesh

#: device policies of a process pool: auto = NCCL when there is a GPU per rank, else gloo on CPU;
#: cpu = always gloo; cuda = NCCL or refuse
DEVICE_POLICIES = ("auto", "cpu", "cuda")
#: the kind used where none is named: every rank a thread of this process
DEFAULT_KIND = "simulated"


@dataclass(frozen=True)
class BackendKind:
    """One backend kind. ``factory`` is ``"module:attribute"``, imported on first build (the
    process kinds pull in multiprocessing machinery); ``options`` are keyword arguments it always
    gets. ``dist``: None (ranks are threads of this process), a torch.distributed backend, or
    "auto" (``choose_dist`` picks per mesh). ``world``: "mesh" (any mesh shape is built) or
    "environment" (the launcher fixed the world size, $WORLD_SIZE). ``reports``: "caller" (this
    process holds every rank's results) or "rank 0" (every rank runs the command; rank 0 prints)."""

    name: str
    summary: str
    factory: str
    options: tuple[tuple[str, object], ...] = ()
    dist: str | None = None
    world: str = "mesh"
    reports: str = "caller"

    def __post_init__(self) -> None:
        if self.world not in ("mesh", "environment") or self.reports not in ("caller", "rank 0"):
            raise BackendError(f"backend kind {self.name!r}: world must be 'mesh' or 'environment' and "
                               f"reports 'caller' or 'rank 0', got {self.world!r}, {self.reports!r}")
        if ":" not in self.factory:
            raise BackendError(f"backend kind {self.name!r}: factory {self.factory!r} is not 'module:attribute'")

    @property
    def processes(self) -> bool:
        """Its ranks are processes with real collectives (not threads of this process)."""
        return self.dist is not None

    def build(self, mesh: DeviceMesh, **kwargs: Any) -> Backend:
        module, _, attribute = self.factory.partition(":")
        factory: Callable[..., Backend] = getattr(importlib.import_module(module), attribute)
        options = dict(self.options)
        if self.dist == "auto" and kwargs.get("backend") is None:
            kwargs.pop("backend", None)
            given = kwargs.get("device_ids") is not None   # the caller placed the ranks on GPUs
            options["backend"] = "nccl" if given else self.dist_for(mesh.size)
        return factory(mesh, **options, **kwargs)

    def dist_for(self, ranks: int) -> str | None:
        """The torch.distributed backend it would use for ``ranks`` ranks (None: threads). A
        launcher's world needs a GPU per rank on each host, this one's; a pool one per rank here."""
        if self.dist != "auto":
            return self.dist
        return choose_dist(1 if self.world == "environment" else ranks, visible_gpus())

    def default_device(self, ranks: int) -> str:
        """Where shards live unless the user says: cuda under NCCL, else the CPU."""
        return "cuda" if self.dist_for(ranks) == "nccl" else "cpu"

    def world_size(self, environ: Mapping[str, str] = os.environ) -> int | None:
        """The fixed number of ranks a launcher started (None: any mesh can be built)."""
        return int(environ.get("WORLD_SIZE", "0")) if self.world == "environment" else None

    def reporting(self, environ: Mapping[str, str] = os.environ) -> bool:
        """Whether this process prints the results."""
        return self.reports == "caller" or environ.get("RANK", "0") == "0"


def choose_dist(ranks: int, gpus: int, policy: str = "auto") -> str:
    """NCCL when there is a GPU per rank and the policy allows it, gloo otherwise (policy "cuda"
    asks for NCCL; whoever passes it refuses a mesh the GPUs cannot hold)."""
    if policy not in DEVICE_POLICIES:
        raise BackendError(f"device policy {policy!r}: expected one of {DEVICE_POLICIES}")
    return "nccl" if policy != "cpu" and gpus >= ranks else "gloo"


def visible_gpus() -> int:
    import torch  # late: reading the table must not pay for torch's CUDA probe

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_KINDS: dict[str, BackendKind] = {}


def register(kind: BackendKind) -> BackendKind:
    """Add a backend kind (a name taken twice is an error: a kind is described once)."""
    if kind.name in _KINDS:
        raise BackendError(f"backend kind {kind.name!r} is registered already")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    _KINDS.pop(name, None)


def backend_kind(name: str) -> BackendKind:
    """The kind of that name, or a BackendError listing the known ones."""
    try:
        return _KINDS[name]
    except KeyError:
        raise BackendError(f"unknown backend {name!r}; expected one of {backend_names()}") from None


def backend_names(where: Callable[[BackendKind], bool] = lambda kind: True) -> tuple[str, ...]:
    """Registered names (in registration order) of the kinds ``where`` accepts."""
    return tuple(name for name, kind in _KINDS.items() if where(kind))


def builds_any_mesh(kind: BackendKind) -> bool:
    """A kind this process builds for any mesh (``plan``, the pytest plugin): not a launcher's world."""
    return kind.world == "mesh"


def measures(kind: BackendKind) -> bool:
    """A kind whose collectives are real, on any mesh (``calibrate`` times them)."""
    return kind.processes and kind.world == "mesh"


def placed_by_policy(kind: BackendKind) -> bool:
    """A kind whose placement the pytest plugin decides (threads, or a pool it puts on gloo or
    NCCL by --sv-device): the plugin's --sv-backend choices."""
    return kind.dist in (None, "auto") and kind.world == "mesh"


def backend_help(names: tuple[str, ...]) -> str:
    """One help text for a --backend option: each offered kind's summary."""
    return "; ".join(f"{name}: {_KINDS[name].summary}" for name in names)


# ---- what a built backend offers beyond ``run`` and ``close`` (the Backend protocol): asked
# here alone, so a backend of the user's (or a test's stand-in) that lacks one still runs

def backend_label(backend: Any) -> str:
    """"simulated", "gloo", "nccl"... plus the device when it is not the CPU."""
    name = getattr(backend, "name", None) or getattr(backend, "backend", None)
    if not isinstance(name, str):
        name = type(backend).__name__.removesuffix("Backend").lower() or type(backend).__name__
    device = str(getattr(backend, "device", "cpu"))
    return name if device == "cpu" else f"{name}/{device}"


def batch_runner(backend: Any) -> Callable[..., list] | None:
    """The backend's ``run_batch`` (many checks in one hand-over to the ranks), or None."""
    return getattr(backend, "run_batch", None)


def start_backend(backend: Any) -> None:
    """Start a backend that starts lazily (a process pool) now, so no timed work pays for it."""
    start = getattr(backend, "start", None)
    if callable(start):
        start()


def take_notices(backend: Any) -> list[str]:
    """What happened to the backend outside any check (a worker found dead and replaced)."""
    take = getattr(backend, "take_notices", None)
    return take() if callable(take) else []


def wires(backend: Any, kind: str) -> tuple[str, str]:
    """(the torch.distributed backend a built backend of ``kind`` uses, its first rank's device):
    "process" names the pool, not what its collectives run on."""
    devices = getattr(backend, "devices", None)
    return getattr(backend, "backend", None) or kind, str(devices[0]) if devices else "cpu"


register(BackendKind("simulated", "all ranks as threads of this process (default)",
                     "shardverify.backends.simulated:SimulatedBackend"))
register(BackendKind("process", "a pool of torch.distributed worker processes, NCCL when there is a GPU "
                                "per rank, else gloo", "shardverify.backends.process:ProcessBackend", dist="auto"))
register(BackendKind("gloo", "a pool of torch.distributed worker processes on gloo (CPU)",
                     "shardverify.backends.process:ProcessBackend", (("backend", "gloo"),), dist="gloo"))
register(BackendKind("nccl", "a pool of torch.distributed worker processes on NCCL (one GPU per rank)",
                     "shardverify.backends.process:ProcessBackend", (("backend", "nccl"),), dist="nccl"))
register(BackendKind("torchrun", "this process is one rank of a world started by torchrun (rank 0 prints)",
                     "shardverify.backends.torchrun:TorchrunBackend", dist="auto", world="environment",
                     reports="rank 0"))

__all__ = ["BackendKind", "DEFAULT_KIND", "DEVICE_POLICIES", "backend_help", "backend_kind", "backend_label",
           "backend_names", "batch_runner", "builds_any_mesh", "choose_dist", "measures", "placed_by_policy", "register",
           "start_backend", "take_notices", "unregister", "visible_gpus", "wires"]
