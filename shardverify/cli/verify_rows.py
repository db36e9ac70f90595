"""One row of `shardverify verify`'s table: a (case, mesh) verified on a backend, the backends
kept per mesh for the rows, the progress line, and error texts as a row shows them. Shared by the
sequential run (`verify_cmd`) and the worker processes of `--jobs` (`verify_jobs`)."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

from shardverify.errors import ShardVerifyError

__all__ = ["Row", "Progress", "make_backend", "row_label", "verify_row", "close_backends", "quiet_tracing",
           "describe_error", "only_replicated", "replicated_warning", "replicated_summary", "Interrupted"]


def only_replicated(strategies) -> bool:
    """No strategy shards anything: the case checks no sharding at all on that mesh."""
    return all(not spec.dim_partition for s in strategies for _, spec in s.sharding_specs)


#: why a case may have only its replicated strategy, said once for every such row
REPLICATED_ONLY = ("the generator offers no sharded strategy there: dims of one element, an avg that unequal "
                   "blocks cannot keep partial, a layout the op refuses on some rank's block")


def replicated_warning(case_id: str, mesh: tuple[int, ...]) -> str:
    return (f"{case_id} on mesh {list(mesh)}: only the replicated strategy exists, so no sharding is "
            f"verified ({REPLICATED_ONLY})")


def replicated_summary(rows: list[Row]) -> list[str]:
    """The rows that verify no sharding, as a reader takes them in: the reason once, then one line
    per op and mesh naming its cases ([] when there are none)."""
    found: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for row in rows:
        if row.warning:
            found.setdefault((row.op, tuple(row.mesh)), []).append(row.case)
    if not found:
        return []
    count = sum(len(cases) for cases in found.values())
    lines = [f"warning: {count} case(s) verify no sharding on their mesh, only the replicated strategy "
             f"exists ({REPLICATED_ONLY}):"]
    for (op, mesh), cases in found.items():
        shown = ", ".join(cases[:4]) + (f" and {len(cases) - 4} more" if len(cases) > 4 else "")
        lines.append(f"  {op} on mesh {list(mesh)}: {shown}")
    return lines


@dataclass
class Row:
    """One (case, mesh) line of the table."""

    op: str
    case: str
    mesh: tuple[int, ...]
    verified: int = 0
    failures: int = 0
    seconds: float = 0.0
    error: str = ""
    warning: str = ""
    results: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"op": self.op, "case": self.case, "mesh": list(self.mesh), "verified": self.verified,
                "failures": self.failures, "seconds": round(self.seconds, 4), "error": self.error or None,
                "warning": self.warning or None,
                "checks": [r.to_json() for r in self.results]}


class Progress:
    """A one-line progress indicator on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, stream=None) -> None:
        stream = sys.stderr if stream is None else stream   # looked up now: it may have been replaced
        self.total, self.done, self.stream = total, 0, stream
        self.enabled = total > 1 and hasattr(stream, "isatty") and stream.isatty()

    def show(self, label: str) -> None:
        if self.enabled:
            width = 24
            filled = width * self.done // max(self.total, 1)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label[:60]:<60}")
            self.stream.flush()

    def step(self) -> None:
        self.done += 1

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()


def make_backend(kind: str, mesh_shape: tuple[int, ...], device: str | None, timeout: float):
    """A backend by CLI name: simulated threads, or a gloo/nccl process pool."""
    from shardverify.backends import get_backend
    from shardverify.sharding.mesh import DeviceMesh

    options = {"timeout": timeout} if device is None else {"timeout": timeout, "device": device}
    backend = get_backend(kind, DeviceMesh(mesh_shape), **options)
    if callable(getattr(backend, "start", None)):
        backend.start()   # a process pool starts now, so no row's time includes it
    return backend


def row_label(item: tuple) -> str:
    op, case_id, _, mesh = item
    return f"{op} {case_id} mesh {list(mesh)}"


def verify_row(item: tuple, backends: dict, backend_kind: str, device: str | None, timeout: float) -> Row:
    """One (op, case id, case, mesh) row: its strategies built and checked on the mesh's backend
    (built once into ``backends``); whatever keeps the case from running fails the row alone."""
    from shardverify.strategies.for_node import strategies_for_node
    from shardverify.verify.engine import verify_case
    from shardverify.verify.memory import check_case_memory

    op, case_id, case, mesh = item
    row = Row(op, case_id, mesh)
    start = time.perf_counter()
    try:
        backend = _backend_for(backends, backend_kind, mesh, device, timeout)
        graph_module, node_name = case.build()
        _check_case_size(case, graph_module)
        check_case_memory(case, tuple(mesh))   # before the strategies, which may build tensors
        strategies = strategies_for_node(graph_module, node_name, backend.mesh)
        if only_replicated(strategies):
            row.warning = replicated_warning(case_id, mesh)
        row.results = verify_case(backend, case, strategies, timeout=timeout)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - one case that cannot run fails its row, not the run
        row.error = describe_error(exc)
    row.seconds = time.perf_counter() - start
    row.verified = len(row.results)
    row.failures = sum(not r.passed for r in row.results) + bool(row.error)
    return row


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `verify`: the rows finished before it, for the partial table."""

    def __init__(self, rows: list[Row], planned: int) -> None:
        super().__init__(f"interrupted after {len(rows)} of {planned} row(s)")
        self.rows, self.planned = rows, planned


def close_backends(backends: dict) -> None:
    for backend in backends.values():
        if backend is not None:
            backend.close()


class _NoPrintedTraceback:
    """Stands in for the ``traceback`` module inside torch's ShapeProp, which prints the
    traceback of an op that fails to trace before re-raising it with the cause attached:
    the CLI reports that cause on the case's row, and prints no traceback."""

    @staticmethod
    def print_exc(*args, **kwargs) -> None:
        return None


def quiet_tracing() -> None:
    """Tracing that prints no traceback and leaves no semaphore: torch.fx's Interpreter opens a
    (disabled) tqdm bar on every run, and tqdm's first bar creates its global lock with a
    multiprocessing RLock, a named semaphore. In a `--jobs` worker (forkserver) that semaphore
    is registered with the resource tracker and unlinked only by the worker's exit handlers,
    which a worker stopped by SIGTERM never runs: the tracker then warned "2 leaked semaphore
    objects" at the end of a stopped run. No bar is shared between processes here, so tqdm's
    lock is a thread lock."""
    import threading

    from torch.fx.passes import shape_prop

    if hasattr(shape_prop, "traceback"):
        shape_prop.traceback = _NoPrintedTraceback   # type: ignore[attr-defined]
    try:
        from tqdm import tqdm
    except ImportError:    # torch then uses a bar of its own, which makes no lock
        return
    tqdm.set_lock(threading.RLock())


def describe_error(exc: BaseException) -> str:
    """An exception and its causes, one clause each: shardverify's own messages in full,
    others by their first line (torch wraps the real cause, e.g. an IndexError, in a long
    tracing message that embeds a traceback of its own)."""
    clauses, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(clauses) < 4:
        seen.add(id(current))
        text = str(current).strip()
        if not isinstance(current, ShardVerifyError):
            text = text.splitlines()[0][:300] if text else ""
        clauses.append(f"{type(current).__name__}: {text}" if text else type(current).__name__)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return "; caused by ".join(clauses)


def _backend_for(backends: dict, kind: str, mesh: tuple[int, ...], device: str | None, timeout: float):
    """The backend of a mesh, built once; a mesh that is too big, or a backend that cannot be
    built, fails every row on that mesh with the same error (and the run goes on)."""
    from shardverify.spec.limits import mesh_problem

    if mesh not in backends:
        backends[mesh] = None
        too_big = mesh_problem(mesh)
        if too_big:
            raise ShardVerifyError(f"mesh {list(mesh)}: {too_big}")
        backends[mesh] = make_backend(kind, mesh, device, timeout)
    if backends[mesh] is None:
        raise ShardVerifyError(f"no backend for mesh {list(mesh)} (it failed to start for an earlier case)")
    return backends[mesh]


def _check_case_size(case, graph_module) -> None:
    """Every tensor the case builds (inputs, module weights) within MAX_TENSOR_ELEMENTS,
    checked on the meta-traced graph before any real memory is allocated."""
    from shardverify.spec.limits import tensor_size_problems

    shapes = [(f"parameter {name}", tuple(t.shape)) for name, t in graph_module.named_parameters()]
    shapes += [(f"input {decl.name}", tuple(decl.shape)) for decl in case.inputs]
    problems = tensor_size_problems(shapes)
    if problems:
        raise ShardVerifyError("; ".join(problems))
