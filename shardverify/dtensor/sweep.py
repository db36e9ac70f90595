"""`shardverify dtensor` with its cases as units (backends/units.py), run by an engine such as
the workers of a Ray cluster: this process (the driver) reads and writes the results folder,
the workers only run cases, so no lock file and no shared folder is involved.

One case on one mesh is one unit.  Each case's result is settled in the order the serial run
(:func:`shardverify.dtensor.run.run_spec`) makes them: spec by spec, mesh by mesh, case by
case.  The serial run gives the first silent finding of each class its attribution and the
first silent or late finding of each class its repro, and which finding is first depends on the
cases before it; a worker ran its case knowing only the stored classes, so :func:`settle` takes
back what a case before it had already made.  The stored files and the report are then the
serial run's, byte for byte but for the seconds.  A case is stored once settled: an interrupted
sweep keeps every case settled so far, and a case that finished while one before it of the same
spec still ran is run again when the sweep resumes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardverify.backends.units import Engine, Unit, UnitFailed, run_units
from shardverify.dtensor.rootcause import fine_key
from shardverify.dtensor.run import DEFAULT_BUDGET, DEFAULT_LIMIT, CaseResult, run_case, stored_keys
from shardverify.dtensor.store import StoredRun, open_run, save_stored, spec_hash

__all__ = ["sweep", "run_case_unit", "settle", "DIED_ON_WORKER"]

#: what a case whose worker died twice says (no combination named: the worker could not store it)
DIED_ON_WORKER = ("run it again without --cluster: a --results run there names the combination that kills "
                  "its process and counts it as raising")


def run_case_unit(spec, case_id: str, case, mesh: tuple[int, ...], limit: int | None, budget: float | None,
                  resume: dict | None, died: dict, explained: frozenset) -> tuple[CaseResult, dict]:
    """One case on one mesh, as the serial run runs it (an error is the case's note), and the
    (culprit, runtime) each attribution replaced (:func:`settle`)."""
    attributed: dict = {}
    try:
        found = run_case(spec, case_id, case, mesh, limit=limit, budget=budget, explained=set(explained),
                         resume=CaseResult.from_json(resume) if resume is not None else None,
                         died={int(i): stage for i, stage in died.items()}, attributed=attributed)
    except Exception as exc:  # noqa: BLE001 - reported with the case, as the serial run does
        found = CaseResult(spec.name, case_id, mesh, note=f"error: {type(exc).__name__}: {exc}")
    return found, attributed


def settle(found: CaseResult, attributed: dict, first: int, rendered: set[str]) -> None:
    """Make ``found``'s findings from index ``first`` on what the serial run makes them, given
    ``rendered``, the classes the cases before it explained (updated): an attribution or a repro
    of a class already explained is taken back."""
    for index in range(first, len(found.findings)):
        finding = found.findings[index]
        if finding.klass == "silent-wrong":
            plain = finding
            if index in attributed:
                culprit, runtime = attributed[index]
                plain = dataclasses.replace(finding, culprit=culprit, runtime=runtime)
            if fine_key(plain) in rendered:
                finding = plain
            else:
                rendered.add(fine_key(plain))
        if finding.klass in ("silent-wrong", "late-failure"):
            if finding.key() in rendered:
                finding = dataclasses.replace(finding, repro="")
            else:
                rendered.add(finding.key())
        found.findings[index] = finding


@dataclass
class _Mesh:
    """One spec on one mesh: its stored run (None without a results folder) and its cases, each a
    stored result or the index of its unit (and how many findings its stored part already had)."""

    mesh: tuple[int, ...]
    saved: StoredRun | None
    path: Path | None
    keys: set[str]
    cases: list[tuple[str, CaseResult | int, int]] = field(default_factory=list)


def sweep(specs: Sequence, meshes, engine: Engine, *, limit: int | None = DEFAULT_LIMIT,
          budget: float | None = DEFAULT_BUDGET, store: Path | None = None, root: Path = Path("."),
          call: Callable[..., Any] = run_case_unit, on_result: Callable[[CaseResult], None] | None = None,
          on_finished: Callable[[str, Any], None] | None = None) -> list[CaseResult]:
    """Every case of ``specs`` on ``meshes`` (each spec's own when None) run by ``engine``; the
    results in the serial run's order.  ``call``: what a unit runs (:func:`run_case_unit`'s
    arguments; its value first, then whatever a caller's wrapper adds, such as warnings counted);
    ``on_result(result)`` as each case is settled, in that order; ``on_finished(label, value)``
    with a unit's value (or its ``UnitFailed``) as it ends, in any order."""
    import torch

    units: list[Unit] = []
    plan: list[list[_Mesh]] = []
    for spec in specs:
        cases = list(spec.op_cases())
        digest = spec_hash(spec, root) if store is not None else ""
        known: set[str] = set()
        spec_plan = []
        for mesh in meshes or spec.verify.meshes:
            mesh = tuple(mesh)
            saved = path = None
            if store is not None:
                saved, path, _ = open_run(store, spec.name, digest, mesh, torch.__version__, limit, budget,
                                          [case_id for case_id, _ in cases])
            entry = _Mesh(mesh, saved, path, stored_keys(saved) if saved is not None else set())
            known |= entry.keys
            for case_id, case in cases:
                if saved is not None and case_id in saved.done:
                    stored = CaseResult.from_json(saved.results[case_id])
                    stored.resumed = True
                    entry.cases.append((case_id, stored, 0))
                    continue
                resume = saved.results.get(case_id) if saved is not None else None
                died = saved.died.get(case_id, {}) if saved is not None else {}
                units.append(Unit(call, (spec, case_id, case, mesh, limit, budget, resume, died, frozenset(known)),
                                  f"{spec.name} {case_id} on {list(mesh)}"))
                entry.cases.append((case_id, len(units) - 1, len(resume["findings"]) if resume else 0))
            spec_plan.append(entry)
        plan.append(spec_plan)

    values: dict[int, Any] = {}
    settled: list[list[CaseResult]] = [[] for _ in specs]
    cursors = [_Cursor(spec, entries, settled[i], on_result) for i, (spec, entries) in enumerate(zip(specs, plan))]
    owner = {index: cursor for cursor in cursors for index in cursor.units()}

    def finished(index: int, value: Any) -> None:
        values[index] = value
        if on_finished is not None:
            on_finished(units[index].label, value)
        owner[index].advance(values)

    for cursor in cursors:
        cursor.advance(values)   # the stored cases before the first unit
    run_units(units, engine, finished)
    return [result for results in settled for result in results]


class _Cursor:
    """Settles one spec's cases in the serial run's order as their units end."""

    def __init__(self, spec, entries: list[_Mesh], out: list[CaseResult], on_result) -> None:
        self.spec, self.out, self.on_result = spec, out, on_result
        self.steps = [(entry, case) for entry in entries for case in entry.cases]
        self.at = 0
        self.rendered: set[str] = set()
        self.opened: set[int] = set()

    def units(self) -> list[int]:
        return [case[1] for _, case in self.steps if isinstance(case[1], int)]

    def advance(self, values: dict[int, Any]) -> None:
        while self.at < len(self.steps):
            entry, (case_id, slot, first) = self.steps[self.at]
            if isinstance(slot, int) and slot not in values:
                return
            if id(entry) not in self.opened:   # the serial run reads a mesh's stored classes as it reaches it
                self.opened.add(id(entry))
                self.rendered |= entry.keys
            found = slot if isinstance(slot, CaseResult) else self._settled(entry, case_id, values.pop(slot), first)
            self.out.append(found)
            self.at += 1
            if self.on_result is not None:
                self.on_result(found)

    def _settled(self, entry: _Mesh, case_id: str, value: Any, first: int) -> CaseResult:
        if isinstance(value, UnitFailed):
            detail = f"{type(value.cause).__name__}: {value.cause}" if value.cause is not None else value.error
            found = CaseResult(self.spec.name, case_id, entry.mesh, note=f"error: {detail}")
            if value.died:   # not stored: a resumed sweep runs it again
                found.note += f"; {DIED_ON_WORKER}"
                return found
        else:
            found, attributed = value[:2]
            settle(found, attributed, first, self.rendered)
        if entry.saved is not None:
            entry.saved.results[case_id] = found.to_json()
            entry.saved.done.append(case_id)
            save_stored(entry.path, entry.saved)
        return found
