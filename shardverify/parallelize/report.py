"""A check's result as a person reads it (the verdict first, the culprit, then the values that
differ, folded past a few) and as JSON."""

from __future__ import annotations

from collections import Counter

from shardverify.parallelize.check import ParallelizeResult

__all__ = ["summary_line", "render", "as_json"]

SHOWN = 6


def summary_line(result: ParallelizeResult) -> str:
    verdict = result.verdict.upper() + (f" ({result.phase})" if result.phase and result.verdict == "silently wrong" else "")
    steps = f", {result.steps} AdamW steps" if result.mode == "train" else ""
    return (f"{verdict}: {result.model} under {result.plan} on mesh {','.join(map(str, result.mesh))}, "
            f"{result.mode}{steps}, {result.dtype}: {result.compared} values compared on every rank, "
            f"{len(result.findings)} outside their budget ({result.cpu_seconds:.1f} CPU-s"
            + (", the rank processes' included)" if any(n.startswith("ran on") for n in result.notes) else ")"))


def render(result: ParallelizeResult, verbose: bool = False) -> str:
    lines = [summary_line(result)]
    if result.verdict == "right" and result.margin is not None and result.margin.what:
        m = result.margin
        lines.append(f"  closest to its budget: {m.what}, error {m.error:.3g} of a budget of {m.budget:.3g} "
                     f"({m.ratio:.2f} of it; the single device's own error there {m.single:.3g})")
    if result.culprit is not None:
        lines.append(f"  first culprit: {result.culprit.line()}")
    if result.failure is not None and (result.culprit is None or result.culprit.cause != "raised"):
        where = f" in {result.failure.module}" if result.failure.module else ""
        lines.append(f"  raised in its {result.failure.stage}{where}: {result.failure.error}")
    for note in result.notes:
        lines.append(f"  note: {note}")
    shown = result.findings if verbose else result.findings[:SHOWN]
    for finding in shown:
        lines.append(f"  - {finding.line()}")
    if len(result.findings) > len(shown):
        phases = Counter(f.phase for f in result.findings[len(shown):])
        lines.append(f"  ... and {len(result.findings) - len(shown)} more ("
                     + ", ".join(f"{n} {p}" for p, n in phases.items()) + "; -v lists them)")
    return "\n".join(lines)


def as_json(result: ParallelizeResult) -> dict:
    culprit = result.culprit
    return {
        "model": result.model, "plan": result.plan, "mesh": list(result.mesh), "mode": result.mode,
        "dtype": result.dtype, "steps": result.steps, "verdict": result.verdict, "phase": result.phase,
        "compared": result.compared, "outside_budget": len(result.findings), "cpu_seconds": round(result.cpu_seconds, 3),
        "culprit": None if culprit is None else {"module": culprit.module, "what": culprit.what, "op": culprit.op,
                                                 "cause": culprit.cause, "detail": culprit.detail,
                                                 "upstream": culprit.upstream},
        "failure": None if result.failure is None else {"stage": result.failure.stage, "module": result.failure.module,
                                                        "error": result.failure.error},
        "findings": [{"phase": f.phase, "what": f.what, "rank": f.rank, "kind": f.kind, "step": f.step,
                      "error": f.error, "budget": f.budget, "single": f.single} for f in result.findings[:50]],
        "notes": list(result.notes), "unmatched_rules": list(result.unmatched),
        "closest": None if result.margin is None else {"value": result.margin.what, "ratio": result.margin.ratio,
                                                       "error": result.margin.error, "budget": result.margin.budget},
    }
