"""`shardverify dtensor` with its cases as units (backends/units.py), run by an engine such as
the workers of a Ray cluster: this process (the driver) reads and writes the results folder,
the workers only run cases, so no lock file and no shared folder is involved.

One case on one mesh is one unit, or several where the stored results (a sample's included) say
it has more than :data:`CHUNK` combinations to run: each chunk runs a span of its combinations and
the chunks are joined in order (:func:`joined`).  Each case's result is settled in the order the serial run
(:func:`shardverify.features.dtensor.run.run_spec`) makes them: spec by spec, mesh by mesh, case by
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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardverify.backends.units import Engine, Unit, UnitFailed, run_units
from shardverify.features.dtensor.rootcause import fine_key
from shardverify.features.dtensor.run import DEFAULT_BUDGET, DEFAULT_LIMIT, CaseResult, run_case, stored_keys
from shardverify.features.dtensor.stored_results import stored_runs
from shardverify.features.dtensor.store import StoredRun, open_run, save_stored, spec_hash

__all__ = ["sweep", "run_case_unit", "settle", "joined", "DIED_ON_WORKER", "CHUNK"]

#: the most combinations of one case a unit runs (about 400 CPU-s at the stored 0.2 s each), where
#: the stored results say how many the case has: the largest cases hold hundreds of thousands
CHUNK = 2000

#: what a case whose worker died twice says (no combination named: the worker could not store it)
DIED_ON_WORKER = ("run it again without --cluster: a --results run there names the combination that kills "
                  "its process and counts it as raising")


def run_case_unit(spec, case_id: str, case, mesh: tuple[int, ...], limit: int | None, budget: float | None,
                  resume: dict | None, died: dict, explained: frozenset,
                  span: tuple[int, int] | None = None) -> tuple[CaseResult, dict]:
    """One case on one mesh (``span``: one chunk of its chosen combinations), as the serial run
    runs it (an error is the case's note), and the (culprit, runtime) each attribution replaced
    (:func:`settle`)."""
    attributed: dict = {}
    try:
        found = run_case(spec, case_id, case, mesh, limit=limit, budget=budget, explained=set(explained),
                         resume=CaseResult.from_json(resume) if resume is not None else None,
                         died={int(i): stage for i, stage in died.items()}, attributed=attributed, span=span)
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


def joined(parts: Sequence[Any]) -> Any:
    """A case's chunk values, in order, as the one value of the case run whole: counts and
    findings added up (each attribution's index moved with its finding); a chunk after one the
    time budget ended adds nothing (the serial run ends the case there); a chunk that failed or
    erred stands for the case."""
    if not parts:
        raise ValueError("a case of no chunk")
    first = parts[0]
    if isinstance(first, UnitFailed) or first[0].note.startswith("error:"):
        return first
    found = dataclasses.replace(first[0], counts=first[0].counts.copy(), findings=list(first[0].findings))
    attributed = dict(first[1])
    for part in parts[1:]:
        if found.counts.get("too-slow"):
            break
        if isinstance(part, UnitFailed) or part[0].note.startswith("error:"):
            return part
        piece, moved = part[0], part[1]
        attributed.update({index + len(found.findings): was for index, was in moved.items()})
        found.findings += piece.findings
        found.counts += piece.counts
        found.executed += piece.executed
        found.seconds += piece.seconds
        found.note = piece.note     # the same but for the budget's words, which the chunk that ended it adds
    extras = [sum((Counter(part[k]) for part in parts if not isinstance(part, UnitFailed)), Counter())
              if isinstance(first[k], dict) else first[k] for k in range(2, len(first))]   # e.g. warnings counted
    return (found, attributed, *extras)


@dataclass
class _Mesh:
    """One spec on one mesh: its stored run (None without a results folder) and its cases, each a
    stored result or the indices of its units, one per chunk (and how many findings its stored
    part already had)."""

    mesh: tuple[int, ...]
    saved: StoredRun | None
    path: Path | None
    keys: set[str]
    cases: list[tuple[str, CaseResult | list[int], int]] = field(default_factory=list)


def sweep(specs: Sequence, meshes, engine: Engine, *, limit: int | None = DEFAULT_LIMIT,
          budget: float | None = DEFAULT_BUDGET, store: Path | None = None, root: Path = Path("."),
          call: Callable[..., Any] = run_case_unit, on_result: Callable[[CaseResult], None] | None = None,
          on_finished: Callable[[str, Any], None] | None = None, chunk: int | None = CHUNK) -> list[CaseResult]:
    """Every case of ``specs`` on ``meshes`` (each spec's own when None) run by ``engine``; the
    results in the serial run's order.  ``call``: what a unit runs (:func:`run_case_unit`'s
    arguments; its value first, then whatever a caller's wrapper adds, such as warnings counted);
    ``on_result(result)`` as each case is settled, in that order; ``on_finished(label, value)``
    with a case's value (or its ``UnitFailed``) as its last unit ends, in any order; ``chunk``:
    the most combinations one unit runs, where the stored results say how many a case has."""
    import torch

    units: list[Unit] = []
    plan: list[list[_Mesh]] = []
    for spec in specs:
        cases = list(spec.op_cases())
        digest = spec_hash(spec, root) if store is not None else ""
        known: set[str] = set()
        spec_plan = []
        chosen = _chosen_counts(store, spec.name, digest, meshes or spec.verify.meshes, limit) if chunk else {}
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
                label = f"{spec.name} {case_id} on {list(mesh)}"
                spans = _chunks(resume["executed"] if resume else 0, chosen.get((mesh, case_id)), chunk)
                entry.cases.append((case_id, list(range(len(units), len(units) + len(spans))),
                                    len(resume["findings"]) if resume else 0))
                units += [Unit(call, (spec, case_id, case, mesh, limit, budget, resume if at == 0 else None, died,
                                      frozenset(known), span), label if span is None else f"{label} [{span[0]}:{span[1]}]")
                          for at, span in enumerate(spans)]
            spec_plan.append(entry)
        plan.append(spec_plan)

    values: dict[int, Any] = {}
    settled: list[list[CaseResult]] = [[] for _ in specs]
    cursors = [_Cursor(spec, entries, settled[i], on_result) for i, (spec, entries) in enumerate(zip(specs, plan))]
    owner = {index: (cursor, slot) for cursor in cursors for slot in cursor.slots() for index in slot}

    def finished(index: int, value: Any) -> None:
        values[index] = value
        cursor, slot = owner[index]
        if on_finished is not None and all(i in values for i in slot):   # the case's last chunk
            on_finished(units[slot[0]].label.rsplit(" [", 1)[0] if len(slot) > 1 else units[slot[0]].label,
                        joined([values[i] for i in slot]))
        cursor.advance(values)

    for cursor in cursors:
        cursor.advance(values)   # the stored cases before the first unit
    run_units(units, engine, finished)
    return [result for results in settled for result in results]


def _chosen_counts(store: Path | None, spec_name: str, digest: str, meshes, limit: int | None) -> dict:
    """(mesh, case) -> how many combinations the run executes, as any stored run of the spec says
    (the run's own file or a sample's); cases no file holds are left out (they run as one unit)."""
    import torch

    if store is None:
        return {}
    found = {}
    for mesh in meshes:
        # every stored run of it, a sample's too: how many combinations a case has does not depend on the limit
        for run in stored_runs(store, spec_name, digest, tuple(mesh), torch.__version__, None):
            for case_id, result in run.results.items():
                total = result["combinations"]
                found[(tuple(mesh), case_id)] = total if limit is None else min(limit, total)
    return found


def _chunks(start: int, total: int | None, chunk: int | None) -> list[tuple[int, int] | None]:
    """The spans one case's units run: the whole rest of it (None) unless its size is known and
    more than one chunk."""
    if total is None or not chunk or total - start <= chunk:
        return [None]
    return [(at, min(at + chunk, total)) for at in range(start, total, chunk)]


class _Cursor:
    """Settles one spec's cases in the serial run's order as their units end."""

    def __init__(self, spec, entries: list[_Mesh], out: list[CaseResult], on_result) -> None:
        self.spec, self.out, self.on_result = spec, out, on_result
        self.steps = [(entry, case) for entry in entries for case in entry.cases]
        self.at = 0
        self.rendered: set[str] = set()
        self.opened: set[int] = set()

    def slots(self) -> list[list[int]]:
        return [case[1] for _, case in self.steps if isinstance(case[1], list)]

    def advance(self, values: dict[int, Any]) -> None:
        while self.at < len(self.steps):
            entry, (case_id, slot, first) = self.steps[self.at]
            if isinstance(slot, list) and any(index not in values for index in slot):
                return
            if id(entry) not in self.opened:   # the serial run reads a mesh's stored classes as it reaches it
                self.opened.add(id(entry))
                self.rendered |= entry.keys
            found = slot if isinstance(slot, CaseResult) else self._settled(
                entry, case_id, joined([values.pop(index) for index in slot]), first)
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
