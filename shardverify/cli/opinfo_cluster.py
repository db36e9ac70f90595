"""`shardverify verify --opinfo --cluster ADDRESS`: each OpInfo entry to sweep is a unit on the
workers of a Ray cluster (backends/ray_units.py); this process stores each entry's results as it
comes back, so the results folder has one writer and no lock file in this path.

A worker keeps torch imported and one on-demand verifier (its simulated meshes) for all its
entries, as the sweep in one process does.  OpInfo entries and ATen overloads do not travel
between processes: a unit carries the entry's name and its specs' dotted target names, and the
worker finds the entry among those of the targets (among all of op_db for an entry no spec lists).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardverify.backends.units import Unit, UnitFailed, run_units
from shardverify.errors import ShardVerifyError

__all__ = ["sweep_entries_on_cluster", "sweep_entry_unit"]

_VERIFIER: list = []   # a worker's on-demand verifier, made for its first entry and kept


def sweep_entry_unit(name: str, op: str, target_names: Sequence[str], meshes: Sequence[tuple[int, ...]],
                     captures: Sequence[str], limit: int):
    """``sweep_entry`` of the OpInfo entry ``name`` on a worker: a SweepResult."""
    from shardverify.features.opinfo.samples import entries_for, op_db
    from shardverify.features.opinfo.sweep import entry_name, sweep_entry
    from shardverify.spec.names import resolve_dotted
    from shardverify.verify.on_demand import OnDemandVerifier

    targets = [resolve_dotted(dotted) for dotted in target_names]
    # an entry no spec lists travels with no target names: it is found among all of op_db
    entry = next((e for e in (entries_for(targets) if targets else op_db()) if entry_name(e) == name), None)
    if entry is None:
        raise ShardVerifyError(f"the OpInfo entry {name} is not among those of "
                               f"{', '.join(target_names) or 'op_db'} on this worker's torch")
    if not _VERIFIER:
        _VERIFIER.append(OnDemandVerifier())
    return sweep_entry(entry, op, targets, meshes, captures, limit, _VERIFIER[0])


def sweep_entries_on_cluster(args: argparse.Namespace, todo: Sequence[tuple[str, str, list]], folder: Path,
                             settings: dict, meshes, captures) -> list[Any]:
    """Each (entry, spec, target names) of ``todo`` swept on the cluster at ``--cluster`` (``--jobs``
    workers) and stored in ``folder`` as it ends; per entry its SweepResult, or why it has none."""
    from shardverify.cli.cluster_option import cluster_engine
    from shardverify.features.opinfo.store import save_entry

    units = [Unit(sweep_entry_unit, (name, op, list(names), [tuple(m) for m in meshes], tuple(captures),
                                     args.opinfo_samples), name) for name, op, names in todo]
    ended = [0]

    def done(index: int, value: Any) -> None:
        ended[0] += 1
        if not isinstance(value, UnitFailed):
            save_entry(folder, todo[index][0], settings, value)
        print(f"opinfo [cluster {ended[0]}/{len(units)}] {todo[index][0]}: "
              + (f"not swept: {value.error}" if isinstance(value, UnitFailed) else
                 f"{len(value.outcomes)} calls, {value.seconds:.1f}s on a worker"), file=sys.stderr, flush=True)

    with cluster_engine(args, _start_worker) as engine:
        found = run_units(units, engine, done)
    return [value.error if isinstance(value, UnitFailed) else value for value in found]


def _start_worker() -> None:
    """A verify worker's set-up, and PyTorch's OpInfo database read (seconds of imports, not in
    the first entry's time)."""
    from shardverify.cli.verify_cluster import _start_actor
    from shardverify.features.opinfo.samples import op_db

    _start_actor()
    op_db()
