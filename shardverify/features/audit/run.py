"""The completeness audit of one op spec: every layout combination of its operands, decided
numerically, against the combinations its strategies offer.

Per case and mesh: enumerate every operand's layouts (shardings that divide, partial sums,
an absent post-added operand), decide one combination per orbit of the mesh's axis
symmetries (the others follow by renaming axes), and compare with what the offered
strategies run the op on. A valid combination no strategy covers is *missing* (unless an
``audit: accept:`` entry of the spec names it); an offered strategy whose combination is
invalid, or whose assumed output layout the local outputs do not form, is *incorrect*.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shardverify import stops
from shardverify.features.audit.combinations import (CaseCombinations, combo_key, offered_strategies, outputs_hold,
                                            outputs_text, spec_handler)
from shardverify.features.audit.offered import offered_combination, own_arguments
from shardverify.spec.accept import family_gaps

__all__ = ["audit_one", "Finding", "CaseAudit", "audit_spec", "audit_case", "spec_handler", "offered_strategies"]


@dataclass(frozen=True)
class Finding:
    """One missing combination or one incorrect strategy, as a printable line."""

    kind: str                      # "missing" | "incorrect"
    line: str
    layouts: tuple[tuple[str, str], ...] = ()
    outputs: str = ""
    strategy: str = ""
    accepted: str = ""             # the reason of the accept entry that covers it (file:line: reason)

    def to_json(self) -> dict:
        found = {"kind": self.kind, "line": self.line, "layouts": dict(self.layouts), "outputs": self.outputs}
        if self.strategy:
            found["strategy"] = self.strategy
        if self.accepted:
            found["accepted"] = self.accepted
        return found


@dataclass
class CaseAudit:
    """The audit of one case on one mesh."""

    op: str
    case: str
    mesh: tuple[int, ...]
    combinations: int = 0          # every combination enumerated (over the limit: those of the sample)
    sampled: int = 0               # over the combination limit: the sample's size (0: every combination)
    decided: int = 0               # decided numerically (one per symmetry orbit)
    offered: int = 0
    valid: int = 0
    covered: int = 0
    masked: int = 0                # offered strategies with ids masked into a sharded dim, found correct
    missing: list[Finding] = field(default_factory=list)     # new: not accepted
    accepted: list[Finding] = field(default_factory=list)
    incorrect: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""
    note: str = ""                 # what was left out, and why (never silent)

    @property
    def failed(self) -> bool:
        return bool(self.missing or self.incorrect or self.error)

    def to_json(self) -> dict:
        return {"op": self.op, "case": self.case, "mesh": list(self.mesh), "combinations": self.combinations,
                "sampled": self.sampled, "decided": self.decided, "offered": self.offered, "valid": self.valid, "covered": self.covered,
                "masked": self.masked,
                "missing": [f.to_json() for f in self.missing], "accepted": [f.to_json() for f in self.accepted],
                "incorrect": [f.to_json() for f in self.incorrect], "seconds": round(self.seconds, 3),
                "error": self.error or None, "note": self.note or None}


def audit_case(spec, case_id: str, case, mesh_shape: tuple[int, ...], point: dict | None = None, *,
               partial_inputs: bool = True) -> CaseAudit:
    """Audit one case of ``spec`` on one mesh (see the module docstring)."""
    start = time.perf_counter()
    result = CaseAudit(spec.name, case_id, tuple(mesh_shape))
    audit = CaseCombinations(spec, case, tuple(mesh_shape), partial_inputs)
    result.note, result.sampled = audit.note, audit.sample
    result.combinations = audit.enumerate()
    result.decided = audit.problem.decided
    result.offered = len(audit.strategies)
    valid = audit.valid()
    needed = audit.needed(valid)
    result.valid = len(needed)
    covered = {key for strategy in audit.strategies
               for key in [_judge_offered(audit, strategy, valid, needed, result)] if key is not None}
    result.covered = len(covered & set(needed))
    _missing(spec, audit, needed, covered, point or {}, result)
    result.seconds = time.perf_counter() - start
    return result


def _judge_offered(audit: CaseCombinations, strategy, valid: dict, needed: dict, result: CaseAudit):
    """One offered strategy against the decided combinations: its incorrect finding (or masked
    count) added to ``result``; the key of the valid combination it covers, or None."""
    names = [o.name for o in audit.operands]
    offered = offered_combination(strategy)
    seen = dict(offered.inputs)
    line = f"{strategy.name}: "
    if offered.problem:
        result.incorrect.append(Finding("incorrect", line + offered.problem, strategy=strategy.name))
        return None
    if set(seen) != set(names):
        result.incorrect.append(Finding("incorrect", line + f"operands {sorted(seen)} are not the op's "
                                        f"{sorted(names)}", strategy=strategy.name))
        return None
    combo = tuple(seen[n].normalized(audit.mesh.shape) for n in names)
    claimed = {name: layout.normalized(audit.mesh.shape) for name, layout in offered.outputs}
    if set(claimed) != set(audit.output_names):
        result.incorrect.append(Finding("incorrect", line + f"outputs {sorted(claimed)} are not the op's "
                                        f"{sorted(audit.output_names)}", strategy=strategy.name))
        return None
    assumed = tuple(claimed[n] for n in audit.output_names)
    text, layouts, _ = audit.describe(combo, assumed)
    key = combo_key(combo)
    if strategy.index_shards:
        # ids into a sharded dim run the op with masking, which the enumeration of raw
        # layouts does not do: this offered combination is decided on its own, as offered
        masked = tuple((names.index(s.index), names.index(s.table), s.dim) for s in strategy.index_shards)
        outcome = audit.decide(combo, masked)
        if not outcome.valid or (outcome.outputs != assumed and not audit.outputs_hold(combo, assumed, masked)):
            result.incorrect.append(Finding("incorrect", f"{line}{text}: with masked ids the op gives "
                                            f"{outcome.reason or outputs_text(outcome.outputs)}",
                                            layouts, outputs_text(assumed), strategy=strategy.name))
        else:
            result.masked += 1
        return None
    own = own_arguments(strategy, audit.problem.shape_arg, audit.mesh)
    if own is not None:
        # local arguments the enumeration does not pass (a range factory's start and end, the
        # sizes of a rank's own blocks: size_params): the offered combination is run with the
        # strategy's own, as offered
        if not all(outputs_hold(problem, combo, assumed, arguments=own) for problem in audit.problems):
            result.incorrect.append(Finding("incorrect", f"{line}{text}: with the strategy's own local "
                                            f"arguments the ranks' outputs do not form it", layouts,
                                            outputs_text(assumed), strategy=strategy.name))
            return None
        return key if key in needed else None
    if key not in valid and combo not in audit.results:
        # a layout the enumeration left out (partial inputs, over the combination limit):
        # this offered combination is decided on its own, as offered
        outcome = audit.decide(combo)
        if not outcome.valid or (outcome.outputs != assumed and not audit.outputs_hold(combo, assumed)):
            result.incorrect.append(Finding("incorrect", f"{line}{text}: the op gives "
                                            f"{outcome.reason or outputs_text(outcome.outputs)}",
                                            layouts, outputs_text(assumed), strategy=strategy.name))
        return None
    if key not in valid:
        outcome = audit.results[combo]
        result.incorrect.append(Finding("incorrect", f"{line}{text}: not valid without communication "
                                        f"({outcome.reason})", layouts, strategy=strategy.name))
        return None
    example, outputs = valid[key]
    if outputs != assumed and not audit.outputs_hold(example, assumed):
        result.incorrect.append(Finding("incorrect", f"{line}{text}: the op gives {outputs_text(outputs)}",
                                        layouts, outputs_text(assumed), strategy=strategy.name))
        return None
    return key


def _missing(spec, audit: CaseCombinations, needed: dict, covered: set, point: dict, result: CaseAudit) -> None:
    """Each needed combination no strategy covers, in ``result`` as missing or, where an accept
    entry of the spec (or its family's known gaps) names it, as accepted."""
    accept = spec.audit_accept + family_gaps(spec.generator)
    for key, (combo, outputs) in needed.items():
        if key in covered:
            continue
        text, layouts, out_text = audit.describe(combo, outputs)
        entry = next((e for e in accept if e.applies(result.mesh, point, dict(layouts), out_text)), None)
        if entry is None:
            result.missing.append(Finding("missing", text, layouts, out_text))
        else:
            result.accepted.append(Finding("missing", text, layouts, out_text,
                                           accepted=f"{entry.where_text()}: {entry.reason}"))


def audit_spec(spec, meshes: list[tuple[int, ...]] | None = None, *, partial_inputs: bool = True,
               on_result=None) -> list[CaseAudit]:
    """Audit every case of ``spec`` on ``meshes`` (default: the spec's meshes)."""
    results = []
    for case_spec, (case_id, case) in zip(spec.cases(), spec.op_cases()):
        for mesh in meshes or spec.verify.meshes:
            stops.raise_if_stopped()   # a stop whose exception was lost on the way (stops.py)
            found = audit_one(spec, case_id, case, tuple(mesh), dict(case_spec.point), partial_inputs)
            results.append(found)
            if on_result is not None:
                on_result(found)
    return results


def audit_one(spec, case_id: str, case, mesh: tuple[int, ...], point: dict, partial_inputs: bool = True) -> CaseAudit:
    """One case on one mesh as :func:`audit_spec` audits it: a spec that skips the audit, or a case
    the audit cannot run, is a row saying so, never left out."""
    if spec.audit_skip:     # the op cannot be run on the combinations the audit tries
        return CaseAudit(spec.name, case_id, mesh, note=f"not audited: {spec.audit_skip}")
    try:
        return audit_case(spec, case_id, case, mesh, point, partial_inputs=partial_inputs)
    except Exception as exc:  # noqa: BLE001 - a case the audit cannot run is reported, never skipped silently
        return CaseAudit(spec.name, case_id, mesh, error=f"{type(exc).__name__}: {exc}")
