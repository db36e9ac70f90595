"""`shardverify verify --cluster ADDRESS`: the (case, mesh) rows as units on a Ray cluster.

Each row is one unit (backends/units.py) run by ``RayEngine`` (backends/ray_units.py) on an
actor that keeps torch imported and one simulated backend per mesh shape for all its rows, as a
`--jobs` worker does.  Rows come back in plan order, so the report (text, --json, --html) is
the one the local run gives; a row whose worker died twice fails with the local pool's words.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shardverify.backends.units import Unit, UnitFailed, run_units
from shardverify.cli.verify_rows import (WORKER_PRELOAD, Interrupted, Progress, Row, describe_error, row_label,
                                          worker_row)

__all__ = ["verify_rows_on_cluster"]

def verify_rows_on_cluster(plan: Sequence[tuple], address: str, workers: int | None, *, device: str | None,
                           timeout: float, progress: Progress, error_maps: bool = False,
                           local_cpus: int = 2, report: Callable[[], dict] | None = None) -> list[Row]:
    """``verify_row`` of every plan item on the Ray cluster at ``address`` (``local``: one started
    here on ``local_cpus`` CPUs), on ``workers`` actors (default: one per CPU of the cluster)."""
    from shardverify.backends.ray_units import RayEngine

    units = [Unit(worker_row, (item, device, timeout, error_maps), row_label(item)) for item in plan]
    rows: list[Row | None] = [None] * len(plan)
    failing = [0]

    def done(index: int, value: Any) -> None:
        row = value if isinstance(value, Row) else _failed_row(plan[index], value)
        rows[index] = row
        failing[0] += bool(row.failures)
        progress.step()
        progress.show(f"{failing[0]} failing so far; {units[index].label}")

    try:
        with RayEngine(address, workers, setup=_start_actor, report=report, local_cpus=local_cpus) as engine:
            run_units(units, engine, done)
    except KeyboardInterrupt:
        raise Interrupted([row for row in rows if row is not None], len(plan)) from None
    return rows  # type: ignore[return-value]


def _failed_row(item: tuple, failed: Any) -> Row:
    """A unit without a row: its worker died twice, or it could not run or travel back."""
    op, case_id, _, mesh = item
    if isinstance(failed, UnitFailed):
        error = describe_error(failed.cause) if failed.cause is not None else failed.error
    else:
        error = f"the worker gave {type(failed).__name__}, not a row"
    return Row(op, case_id, mesh, error=error, failures=1)


def _start_actor() -> None:
    """An actor's set-up, once: the collector settings and quiet tracing of a checking process,
    one torch thread (its one CPU), and the verify engine imported before the first row."""
    import importlib

    import torch

    from shardverify.backends.gc_policy import tune_for_checking
    from shardverify.cli.verify_rows import quiet_tracing

    for name in WORKER_PRELOAD:   # not in the first row's time (as the --jobs forkserver preloads them)
        importlib.import_module(name)
    torch.set_num_threads(1)
    tune_for_checking()
    quiet_tracing()
