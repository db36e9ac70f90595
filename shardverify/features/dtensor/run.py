"""Execute DTensor on every input combination of an op spec's cases and classify each
(:mod:`shardverify.features.dtensor.verdicts`).

No symmetry reduction: the audit keeps one combination per orbit of mesh-axis swaps because its
strategies are symmetric under them, but DTensor is not (its rules and runtime treat mesh axis 0
and 1 differently: an embedding's mask on one axis and its shard on the other fails while the
mirror is right), so every combination is its own case here.

The combinations are the audit's (:class:`shardverify.features.audit.combinations.CaseCombinations`): every layout of every
operand, uneven blocks, both shard orders and partial-sum inputs included. Each one executed is
also decided numerically as the audit decides it, so a correct DTensor result that communicated
can be told from one that did not need to. A case with more combinations than ``limit``
executes an evenly spaced sample of them and says how many it left out.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from dataclasses import dataclass, field

from pathlib import Path

from shardverify import stops
from shardverify.features.audit.combinations import CaseCombinations
from shardverify.features.dtensor.attribute import backward_raise
from shardverify.features.dtensor.execute import CaseRunner, Execution, quiet_dtensor
from shardverify.features.dtensor.placements import placements_of, placements_text
from shardverify.features.dtensor.repro import render_repro, repro_case
from shardverify.features.dtensor.rootcause import fine_key
from shardverify.features.dtensor.store import StoredRun, open_run, save_stored, spec_hash, write_running
from shardverify.features.dtensor.verdicts import Finding, classify, runtime_against_rule
from shardverify.features.dtensor.world import local_world

__all__ = ["CaseResult", "run_case", "run_spec", "rebuild_repro", "rebuild_case", "execute_combos",
           "present_combinations", "DEFAULT_LIMIT", "DEFAULT_BUDGET", "budget_skipped", "stored_keys"]

DEFAULT_LIMIT = 600
DEFAULT_BUDGET = 20.0   # CPU seconds one combination may take (the machine's load does not count)
CHECKPOINT_SECONDS = 60.0
DIED = ("the process died on this combination (a native crash inside torch, such as SIGFPE or SIGSEGV), "
        "found when the stored run resumed and not run again")   # how often a case in progress is stored (--results)


@dataclass
class CaseResult:
    """One (op, case, mesh): how many combinations there were and ran, the count per class and
    every finding that is not "agrees"."""

    op: str
    case: str
    mesh: tuple[int, ...]
    combinations: int = 0          # input combinations (every one, absent operands left out)
    executed: int = 0
    counts: Counter = field(default_factory=Counter)
    findings: list[Finding] = field(default_factory=list)     # every class but "agrees"
    note: str = ""
    seconds: float = 0.0
    resumed: bool = False          # read back from a results folder (--results), not run now

    @classmethod
    def from_json(cls, item: dict) -> "CaseResult":
        """A result as :meth:`to_json` saved it (findings without their repro scripts)."""
        return cls(item["op"], item["case"], tuple(item["mesh"]), item["combinations"], item["executed"],
                   Counter(item["counts"]), [Finding.from_json(f) for f in item["findings"]], item["note"] or "",
                   item["seconds"])

    def to_json(self) -> dict:
        return {"op": self.op, "case": self.case, "mesh": list(self.mesh), "combinations": self.combinations,
                "executed": self.executed, "counts": dict(self.counts), "note": self.note or None,
                "seconds": round(self.seconds, 3), "findings": [f.to_json() for f in self.findings]}


def stored_keys(saved: StoredRun) -> set[str]:
    """The silent and late classes a stored run found: each had its repro made when it was found."""
    return {f.key() for r in saved.results.values() for f in CaseResult.from_json(r).findings
            if f.klass in ("silent-wrong", "late-failure")}


def _sample(items: list, limit: int | None) -> list:
    if limit is None or len(items) <= limit:
        return items
    # integer steps: a sample of k is part of every sample of a multiple of k (CI's of the docs')
    return [items[i * len(items) // limit] for i in range(limit)]


def run_case(spec, case_id: str, case, mesh_shape: tuple[int, ...], *, limit: int | None = DEFAULT_LIMIT,
             partial_inputs: bool = True, budget: float | None = DEFAULT_BUDGET,
             explained: set[str] | None = None, resume: CaseResult | None = None, checkpoint=None,
             starting=None, died: dict | None = None, attributed: dict | None = None,
             span: tuple[int, int] | None = None) -> CaseResult:
    """Execute DTensor on the case's input combinations on a mesh of ``mesh_shape``; ``resume``:
    the stored result of an interrupted run of this case, continued at its next combination;
    ``checkpoint(result)`` is called with the result so far every :data:`CHECKPOINT_SECONDS`;
    ``attributed``, ``span``: :func:`execute_combos`'s."""
    start = time.perf_counter()
    result = CaseResult(spec.name, case_id, tuple(mesh_shape)) if resume is None else resume
    before = result.seconds
    # partial max/min inputs are left out: DTensor defines no backward for a Partial("max") input
    audit = CaseCombinations(spec, case, tuple(mesh_shape), partial_inputs=partial_inputs, extremum_inputs=False)
    result.note = audit.note
    # only the combinations executed are decided: a sample of attention's 4 operands on (2, 2)
    # needs a few hundred decisions, not the tens of thousands of the whole audit
    combos = present_combinations(audit.combinations())

    def timed(found: CaseResult) -> None:
        found.seconds = before + time.perf_counter() - start
        if checkpoint is not None:
            checkpoint(found)

    execute_combos(result, audit.problem, audit.operands, combos, audit.decide, limit, budget, explained,
                   checkpoint=timed, starting=starting, died=died, attributed=attributed, span=span)
    result.seconds = before + time.perf_counter() - start
    return result


#: how a case's note says what the time budget left out (written by execute_combos, read by budget_skipped)
_BUDGET_LEFT = "the case's other {} chosen combination(s) not executed"
_BUDGET_LEFT_READ = re.compile(re.escape(_BUDGET_LEFT).replace(r"\{\}", r"(\d+)"))


def budget_skipped(result: CaseResult) -> int:
    """Combinations of the case the time budget left unchecked: each one found too slow and the
    chosen ones after it, never run (as the case's note says, stored results included); 0 when
    the budget cut nothing."""
    slow = result.counts.get("too-slow", 0)
    if not slow:
        return 0
    return slow + sum(int(n) for n in _BUDGET_LEFT_READ.findall(result.note or ""))


def present_combinations(combos) -> list:
    """Every combination whose operands are all present (an absent, post-added operand is no
    DTensor input); no mesh-axis orbit is folded: DTensor is not symmetric under axis swaps."""
    return [combo for combo in combos if not any(layout.absent for layout in combo)]


def execute_combos(result: CaseResult, problem, operands, combos: list, outcome_of, limit: int | None,
                   budget: float | None = DEFAULT_BUDGET, explained: set[str] | None = None,
                   checkpoint=None, starting=None, died: dict | None = None, attributed: dict | None = None,
                   span: tuple[int, int] | None = None) -> None:
    """Execute ``combos`` (or a sample of ``limit``) on DTensor, classifying each against the
    audit's ``outcome_of(combo)`` (whether a local strategy exists), into ``result``. The first
    silent or late finding of each class gets its repro and attribution; ``explained``: the
    classes that already have them (shared by a spec's cases and meshes, so each is explained once).
    A ``result`` that already executed some (a stored run resumed) continues at the next one;
    ``checkpoint(result)`` is called every :data:`CHECKPOINT_SECONDS` with the result so far,
    ``starting(index, stage)`` before each combination's local check and its DTensor execution;
    ``died``: index -> the stage a process died in (a native crash in torch), each counted as
    raising without running it again; ``attributed``: filled with finding index -> the (culprit,
    runtime) an attribution replaced (a sweep whose cases ran apart undoes those a case before it
    had made: dtensor/sweep.py); ``span``: only the chosen combinations from ``span[0]`` to before
    ``span[1]`` (a chunk of the case; default: from the next one not executed to the last)."""
    died = died or {}
    mesh_shape = result.mesh
    if not operands:   # a factory op (arange, full): no DTensor goes in, a plain tensor comes out
        _add_note(result, "no tensor operand: DTensor is not involved (the op makes a plain tensor), nothing executed")
        return
    result.combinations = len(combos)
    chosen = _sample(combos, limit)
    if len(chosen) < len(combos):
        _add_note(result, f"{len(combos) - len(chosen)} of {len(combos)} combinations not executed (limit {limit})")
    rendered = set() if explained is None else explained     # keys, and fine keys attributed
    saved = time.perf_counter()
    with quiet_dtensor(), local_world(tuple(mesh_shape)) as (mesh, mode):
        runner = CaseRunner(problem, operands, mesh, mode, budget=budget)
        first, end = (result.executed, len(chosen)) if span is None else span
        for done, combo in enumerate(chosen):
            stops.raise_if_stopped()   # a stop whose exception was lost on the way (stops.py)
            if done < first:      # executed before the run was interrupted, or another chunk's
                continue
            if done >= end:
                break
            if checkpoint is not None and time.perf_counter() - saved > CHECKPOINT_SECONDS:
                checkpoint(result)
                saved = time.perf_counter()
            stage, outcome = died.get(done, ""), None     # a stage the process died in is never run again
            if "DTensor" in stage:
                execution = Execution("died", f"{DIED} ({stage})")
            else:
                if not stage:      # the audit's local check of it (whether a strategy runs it locally)
                    if starting is not None:
                        starting(done, "the local check of it")
                    outcome = outcome_of(combo)
                if starting is not None:
                    starting(done, "DTensor's execution")
                execution = runner.run(combo)
                stops.raise_if_stopped()   # not counted as the combination's result: what raised was the stop
            klass, phase = classify(execution, bool(outcome is not None and outcome.valid))
            result.executed += 1
            result.counts[klass] += 1
            if klass == "too-slow" and len(chosen) > done + 1:
                _add_note(result, f"DTensor took over {budget:g} s of CPU time on {_line(operands, combo, mesh_shape)}; "
                          + _BUDGET_LEFT.format(len(chosen) - done - 1))
                break
            if klass == "agrees":
                continue
            finding = _finding(result, operands, combo, klass, phase, execution, outcome)
            # the first finding of each class gets its repro; of each (class, culprit as its rule and
            # error read, severity) its attribution too: a second fault under a known key is named
            if klass == "silent-wrong" and fine_key(finding) not in rendered:
                rendered.add(fine_key(finding))
                step = runner.culprit(combo)
                if step is not None:
                    if attributed is not None:
                        attributed[len(result.findings)] = (finding.culprit, finding.runtime)
                    finding = dataclasses.replace(finding, culprit=str(step), runtime=step.verdict)
            if klass in ("silent-wrong", "late-failure") and finding.key() not in rendered:
                rendered.add(finding.key())
                finding = dataclasses.replace(finding, repro=_repro(problem, operands, combo, mesh_shape, finding))
            result.findings.append(finding)


def _add_note(result: CaseResult, text: str) -> None:
    result.note = f"{result.note}; {text}" if result.note else text


def _finding(result: CaseResult, operands, combo, klass: str, phase: str, execution, outcome) -> Finding:
    """A combination's finding as executed (``outcome``: the audit's decision, None when the
    process died making it), before any repro or attribution is added."""
    mesh_shape = result.mesh
    return Finding(
        result.op, result.case, tuple(mesh_shape),
        tuple((o.role, str(layout)) for o, layout in zip(operands, combo)),
        tuple((o.role, placements_text(placements_of(layout, mesh_shape))) for o, layout in zip(operands, combo)),
        klass, phase, execution.detail, str(execution.rule) if execution.rule else "",
        runtime_against_rule(execution, klass),
        ("not decided (the process died deciding it)" if outcome is None else ", ".join(map(str, outcome.outputs)) if outcome.valid
         else f"none ({outcome.reason})"),
        _comms(execution),
        culprit=backward_raise(execution.raised_in, execution.detail) if execution.failed == "backward-raises" else "")


def _line(operands, combo, mesh_shape) -> str:
    return " ".join(f"{o.role}={placements_text(placements_of(layout, mesh_shape))}" for o, layout in zip(operands, combo))


def _comms(execution) -> str:
    parts = [f"{phase} " + ", ".join(f"{n} {name}" for name, n in counts)
             for phase, counts in (("forward", execution.forward_comms), ("backward", execution.backward_comms))
             if counts]
    if execution.resharded:
        parts.insert(0, "redistributes " + ", ".join(dict.fromkeys(execution.resharded)))
    return "; ".join(parts)


def _repro(problem, operands, combo, mesh_shape, finding: Finding) -> str:
    import torch

    what = ("returns a DTensor and fails later" if finding.klass == "late-failure" else
            f"computes wrong {'gradients' if finding.phase == 'backward' else 'values or shapes'} silently")
    title = (f"DTensor (torch {torch.__version__}) {what}: "
             f"{finding.op} ({finding.case}) on mesh {tuple(mesh_shape)}, {finding.line}.\n{finding.detail}"
             + (f"\n{finding.rule}" if finding.rule else ""))
    try:
        return render_repro(problem, operands, combo, tuple(mesh_shape), title)
    except Exception as exc:  # noqa: BLE001 - a call this renderer cannot write as source
        return f"# no repro: {type(exc).__name__}: {exc}\n"


def _stored_combo(spec, finding: Finding):
    """(audit, combo) of a stored finding: its case's combinations made again and the one with
    the finding's layouts, or why there is none in one line (the spec's grid or the audit's
    layouts changed since it was stored, or a field of the stored finding is not what it should
    be: nothing of it is used but to pick the combination)."""
    mesh, layouts = finding.mesh, finding.layouts
    if not (isinstance(mesh, tuple) and 1 <= len(mesh) <= 4 and all(type(m) is int and 1 <= m <= 64 for m in mesh)):
        return f"the stored finding's mesh {str(mesh)[:80]!r} is not 1 to 4 sizes of 1 to 64"
    if not (isinstance(layouts, tuple) and all(isinstance(p, tuple) and len(p) == 2 and
                                               all(isinstance(t, str) for t in p) for p in layouts)):
        return f"the stored finding's layouts {str(layouts)[:80]!r} are not role -> layout text"
    cases = dict(spec.op_cases())
    if not isinstance(finding.case, str) or finding.case not in cases:
        return f"{spec.name} has no case {str(finding.case)[:100]!r} any more"
    audit = CaseCombinations(spec, cases[finding.case], mesh, partial_inputs=True, extremum_inputs=False)
    for combo in present_combinations(audit.combinations()):
        if tuple((o.role, str(layout)) for o, layout in zip(audit.operands, combo)) == layouts:
            return audit, combo
    return f"no combination of {finding.case} on {mesh} has the layouts {dict(layouts)}"


def rebuild_repro(spec, finding: Finding) -> str:
    """The repro script of a stored finding (stored without it), or an error's script (``# no
    repro: ...``) when its combination cannot be found (:func:`_stored_combo`)."""
    found = _stored_combo(spec, finding)
    if isinstance(found, str):
        return f"# no repro: {found}\n"
    audit, combo = found
    return _repro(audit.problem, audit.operands, combo, finding.mesh, finding)


def rebuild_case(spec, finding: Finding) -> dict | str:
    """The repro case (:func:`shardverify.features.dtensor.repro.repro_case`) of a finding, made again from
    its spec, or why it cannot be, in one line."""
    found = _stored_combo(spec, finding)
    if isinstance(found, str):
        return found
    audit, combo = found
    try:
        return repro_case(audit.problem, audit.operands, combo, finding.mesh)
    except Exception as exc:  # noqa: BLE001 - a call this case cannot hold as data
        return f"{type(exc).__name__}: {exc}"


def run_spec(spec, meshes, *, limit: int | None = DEFAULT_LIMIT, budget: float | None = DEFAULT_BUDGET,
             on_result=None, store: Path | None = None, root: Path = Path(".")) -> list[CaseResult]:
    """Every case of ``spec`` on every mesh (mesh by mesh, so a stored run completes a mesh
    before the next); a case that cannot run is a result with its error as the note, never left
    out. ``store``: a results folder (:mod:`shardverify.features.dtensor.store`) that cases already done
    are read from, a case in progress continues from, and every result is written to."""
    import torch

    results = []
    explained: set[str] = set()
    cases = list(spec.op_cases())
    digest = spec_hash(spec, root) if store is not None else ""
    for mesh in meshes or spec.verify.meshes:
        mesh = tuple(mesh)
        saved, path, running = None, None, None
        if store is not None:
            saved, path, running = open_run(store, spec.name, digest, mesh, torch.__version__, limit, budget,
                                            [case_id for case_id, _ in cases])
            explained |= stored_keys(saved)   # their repro was made then
        for case_id, case in cases:
            if saved is not None and case_id in saved.done:
                found = CaseResult.from_json(saved.results[case_id])
                found.resumed = True
            else:
                resume = (CaseResult.from_json(saved.results[case_id])
                          if saved is not None and case_id in saved.results else None)

                def keep(result: CaseResult, done: bool = False, case_id=case_id, saved=saved, path=path) -> None:
                    if saved is not None:
                        saved.results[case_id] = result.to_json()
                        if done:
                            saved.done.append(case_id)
                        save_stored(path, saved)

                def starting(index: int, stage: str, case_id=case_id, running=running) -> None:
                    if running is not None:
                        write_running(running, case_id, index, stage)

                died = {int(i): stage for i, stage in saved.died.get(case_id, {}).items()} if saved else {}
                try:
                    found = run_case(spec, case_id, case, mesh, limit=limit, budget=budget, explained=explained,
                                     resume=resume, checkpoint=keep, starting=starting, died=died)
                except Exception as exc:  # noqa: BLE001 - reported with the case, not skipped
                    stops.raise_if_stopped()   # unless it was a stop, come back as another exception
                    found = CaseResult(spec.name, case_id, mesh, note=f"error: {type(exc).__name__}: {exc}")
                except BaseException:     # stopped (Ctrl-C, SIGTERM): the combination did not kill it
                    if running is not None:
                        running.unlink(missing_ok=True)
                    raise
                keep(found, done=True)
                if saved is not None and running.exists():
                    running.unlink()
            results.append(found)
            if on_result is not None:
                on_result(found)
    return results
