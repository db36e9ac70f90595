"""A check's result as a person reads it (the verdict first, the culprit, then the values that
differ, folded past a few) and as JSON."""

from __future__ import annotations

from collections import Counter

from shardverify.features.parallelize.check import ParallelizeResult

__all__ = ["summary_line", "render", "render_runs", "as_json"]

SHOWN = 6


def summary_line(result: ParallelizeResult) -> str:
    verdict = result.verdict.upper() + (f" ({result.phase})" if result.phase and result.verdict == "silently wrong" else "")
    steps = f", {result.steps} AdamW steps" if result.mode == "train" else ""
    return (f"{verdict}: {result.model} under {result.plan} on mesh {','.join(map(str, result.mesh))}, "
            f"{result.mode}{steps}, {result.dtype}: {result.compared} values compared on every rank, "
            f"{len(result.findings)} outside their budget ({result.cpu_seconds:.1f} CPU-s"
            + (", the rank processes' included)" if any(n.startswith("ran on") for n in result.notes) else ")"))


def render(result: ParallelizeResult, verbose: bool = False, culprit: bool = True) -> str:
    """One run: its verdict line, the first culprit (unless ``culprit`` is False: said above it
    already), notes and the values outside their budget (a few; every one with ``verbose``)."""
    lines = [summary_line(result)]
    if result.verdict == "right" and result.margin is not None and result.margin.what:
        m = result.margin
        lines.append(f"  closest to its budget: {m.what}, error {m.error:.3g} of a budget of {m.budget:.3g} "
                     f"({m.ratio:.2f} of it; the single device's own error there {m.single:.3g})")
    if result.culprit is not None and culprit:
        lines.append(f"  first culprit: {result.culprit.line()}")
    if result.failure is not None and culprit and (result.culprit is None or result.culprit.cause != "raised"):
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


def _first_cause(result: ParallelizeResult) -> str:
    """What a wrong run's verdict names first: its culprit, else where it raised."""
    if result.culprit is not None:
        return f"first culprit: {result.culprit.line()}"
    if result.failure is not None:
        where = f" in {result.failure.module}" if result.failure.module else ""
        return f"first culprit: raised in its {result.failure.stage}{where}: {result.failure.error}"
    return ""


def render_runs(results: list[ParallelizeResult], verbose: bool = False) -> str:
    """Every run of one command, verdict first: PASS or FAIL over all of them with the model and
    plan, the first wrong run's first culprit, then each run's own verdict and evidence."""
    wrong = [r for r in results if not r.passed]
    names = sorted({f"{r.model} under {r.plan}" for r in results})
    lines = [f"{'PASS' if not wrong else 'FAIL'}: {len(results) - len(wrong)} of {len(results)} runs match the "
             f"single device ({'; '.join(names)})"]
    first = wrong[0] if wrong else None
    cause = "" if first is None else _first_cause(first)
    if cause:
        run = "" if len(results) == 1 else f" [mesh {','.join(map(str, first.mesh))}, {first.mode}]"
        lines.append(cause + run)
    for result in results:
        lines.append(render(result, verbose, culprit=result is not first or not cause))
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
