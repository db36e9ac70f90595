"""`shardverify audit --cluster ADDRESS`: each case of each spec on each mesh a unit on the workers
of a Ray cluster (backends/ray_units.py).  Rows reach the report in the order the audit in one
process gives them, each as soon as every row before it is in (so Ctrl-C prints those), and the
warnings torch gives on a worker are counted there and added to the run's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from shardverify.backends.units import Unit, UnitFailed, run_units
from shardverify.cli.progress import Progress
from shardverify.cli.row_warnings import Caught, caught_warnings

__all__ = ["audit_on_cluster"]


def audit_on_cluster(args: argparse.Namespace, specs, progress: Progress, caught: Caught,
                     on_result: Callable) -> None:
    """``audit_one`` of every (spec, case, mesh) on ``--jobs`` workers of the cluster at
    ``--cluster``; ``on_result(row)`` in the one-process order."""
    from shardverify.features.audit.run import CaseAudit
    from shardverify.cli.cluster_option import cluster_engine
    from shardverify.cli.verify_cluster import _start_actor

    items = [(spec, case_id, case, tuple(mesh), dict(case_spec.point))
             for spec in specs for case_spec, (case_id, case) in zip(spec.cases(), spec.op_cases())
             for mesh in args.mesh or spec.verify.meshes]
    units = [Unit(_audit_counting_warnings, (*item, args.partial_inputs), f"{item[0].name} {item[1]} on mesh {item[3]}")
             for item in items]
    rows: dict[int, Any] = {}
    given = [0]

    def done(index: int, value: Any) -> None:
        spec, case_id, _, mesh, _ = items[index]
        if isinstance(value, UnitFailed):   # its worker died twice, or the row could not travel back
            rows[index] = CaseAudit(spec.name, case_id, mesh, error=value.error)
        else:
            rows[index], counts = value
            caught.counts.update(counts)
        progress.step()
        with caught.outside():
            progress.show(units[index].label)
        while given[0] in rows:
            on_result(rows.pop(given[0]))
            given[0] += 1

    with cluster_engine(args, _start_actor) as engine:
        run_units(units, engine, done)


def _audit_counting_warnings(*args) -> tuple:
    """``audit_one`` on a worker, and the warnings torch gave meanwhile (message -> count)."""
    from shardverify.features.audit.run import audit_one

    with caught_warnings() as found:
        row = audit_one(*args)
    return row, dict(found.counts)
