"""One row of `shardverify verify`'s table: a (case, mesh) verified on a backend, the backends
kept per mesh for the rows, and error texts as a row shows them (the progress line is
`shardverify.cli.progress`'s, named here too for the modules that import it from here). Shared by the
sequential run (`verify_cmd`) and the worker processes of `--jobs` (`verify_jobs`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from shardverify import stops
from shardverify.backends.registry import start_backend
from shardverify.cli.progress import Progress
from shardverify.errors import ShardVerifyError

__all__ = ["Row", "Progress", "make_backend", "row_label", "verify_row", "close_backends", "quiet_tracing",
           "describe_error", "only_replicated", "replicated_warning", "replicated_summary", "replicated_note",
           "Interrupted"]


def only_replicated(strategies) -> bool:
    """No strategy shards anything: the case checks no sharding at all on that mesh."""
    return all(not spec.dim_partition for s in strategies for _, spec in s.sharding_specs)


#: why a case may have only its replicated strategy, said once for every such row
REPLICATED_ONLY = ("the generator offers no sharded strategy there: dims of one element, an avg that unequal "
                   "blocks cannot keep partial, a layout the op refuses on some rank's block")


def replicated_warning(case_id: str, mesh: tuple[int, ...]) -> str:
    return (f"{case_id} on mesh {list(mesh)}: only the replicated strategy exists, so no sharding is "
            f"verified ({REPLICATED_ONLY})")


#: the same, as the text report says it to someone who knows sharding but not this tool's parts
WHY_REPLICATED_ONLY = ("no dim can be split on that mesh: dims of one element, a mean that uneven blocks cannot "
                       "keep as a partial sum, or a layout the op cannot run on some rank's block")


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
    lines = [f"only the replicated strategy exists for {_cases(count)} on their mesh, so no sharding was "
             f"checked there ({WHY_REPLICATED_ONLY}):"]
    for (op, mesh), cases in found.items():
        lines.append(f"  {op} on mesh {tuple(mesh)}: {', '.join(cases)}")
    return lines


def replicated_note(rows: list[Row]) -> str:
    """The same rows in one line of the short report, whatever their number ("" when none)."""
    count = sum(bool(row.warning) for row in rows)
    if not count:
        return ""
    return (f"note: only the replicated strategy exists for {_cases(count)} on their mesh, so no sharding was "
            "checked there: see -v")


def _cases(count: int) -> str:
    return f"{count} case{'' if count == 1 else 's'}"


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
    #: what torch warned while the row ran, message -> count; not in the JSON: which row computes a
    #: value the engine caches (and warns) depends on how the rows are shared among --jobs processes
    torch_warnings: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"op": self.op, "case": self.case, "mesh": list(self.mesh), "verified": self.verified,
                "failures": self.failures, "seconds": round(self.seconds, 4), "error": self.error or None,
                "warning": self.warning or None,
                "checks": [r.to_json() for r in self.results]}


def make_backend(kind: str, mesh_shape: tuple[int, ...], device: str | None, timeout: float):
    """A backend by CLI name: simulated threads, or a gloo/nccl process pool."""
    from shardverify.backends import get_backend
    from shardverify.sharding.mesh import DeviceMesh

    options = {"timeout": timeout} if device is None else {"timeout": timeout, "device": device}
    backend = get_backend(kind, DeviceMesh(mesh_shape), **options)
    start_backend(backend)   # a process pool starts now, so no row's time includes it
    return backend


def row_label(item: tuple) -> str:
    op, case_id, _, mesh = item
    return f"{op} {case_id} on mesh {tuple(mesh)}"


def verify_row(item: tuple, backends: dict, backend_kind: str, device: str | None, timeout: float) -> Row:
    """One (op, case id, case, mesh) row: its strategies built and checked on the mesh's backend
    (built once into ``backends``); whatever keeps the case from running fails the row alone. The
    warnings torch gives meanwhile are counted on the row, not printed (row_warnings)."""
    from shardverify.cli.row_warnings import caught_warnings

    stops.raise_if_stopped()   # a stop whose exception was lost on the way (stops.py)
    op, case_id, case, mesh = item
    row = Row(op, case_id, mesh)
    start = time.perf_counter()
    # a process backend's pool may start during the row: its processes keep the real stderr
    with caught_warnings(descriptor=backend_kind == "simulated") as found:
        _verify_into(row, item, backends, backend_kind, device, timeout)
    row.torch_warnings = dict(found.counts)
    row.seconds = time.perf_counter() - start
    row.verified = len(row.results)
    row.failures = sum(not r.passed for r in row.results) + bool(row.error)
    return row


def _verify_into(row: Row, item: tuple, backends: dict, backend_kind: str, device: str | None,
                 timeout: float) -> None:
    from shardverify.strategies.for_node import strategies_for_node
    from shardverify.verify.engine import verify_case
    from shardverify.verify.memory import check_case_memory

    _, case_id, case, mesh = item
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
        stops.raise_if_stopped()   # unless it was a stop, come back as another exception
        row.error = describe_error(exc)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `verify`: the rows finished before it, for the partial table."""

    def __init__(self, rows: list[Row], planned: int) -> None:
        super().__init__(f"interrupted after {len(rows)} of {planned} row(s)")
        self.rows, self.planned = rows, planned


def close_backends(backends: dict) -> None:
    for backend in backends.values():
        if backend is not None:
            backend.close()


#: what a worker process (a `--jobs` pool worker, a `--cluster` actor) imports before its first row
WORKER_PRELOAD = ("shardverify.cli.verify_rows", "shardverify.verify.engine", "shardverify.strategies.for_node",
                  "torch._dynamo")
#: a worker process's simulated backends by mesh shape, kept between its rows
WORKER_BACKENDS: dict = {}


def worker_row(item: tuple, device: str | None, timeout: float, error_maps: bool) -> Row:
    """``verify_row`` of one plan item in a worker process, on its backends kept between rows
    (``error_maps``: failing checks keep where they are wrong, verify/error_map.py)."""
    return worker_rows((item,), device, timeout, error_maps)[0]


def worker_rows(items: Sequence[tuple], device: str | None, timeout: float, error_maps: bool) -> list[Row]:
    """:func:`worker_row` of each item, in order: one case's rows on its meshes, which share
    what a process keeps per case (its trace, reference, distinguishing seeds and the op's meta
    calls)."""
    from shardverify.verify.error_map import keep_error_maps

    with keep_error_maps() if error_maps else contextlib.nullcontext():
        return [verify_row(item, WORKER_BACKENDS, "simulated", device, timeout) for item in items]


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

    from shardverify.capture.fx import UnprintedTraceback

    if hasattr(shape_prop, "traceback"):
        shape_prop.traceback = UnprintedTraceback()   # type: ignore[attr-defined]
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
