"""The page of a `shardverify dtensor` run: the verdict, a matrix of cases by outcome, the root
causes with their severity, then each class of wrong results with its combinations, DTensor's
rule, the culprit, its root cause and severity, and its repro."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from shardverify.features.dtensor.accepted import Accepted
from shardverify.features.dtensor.rootcause import SEVERITIES, culprit_of, is_corruption, severity_of
from shardverify.features.dtensor.run import CaseResult
from shardverify.features.dtensor.verdicts import CLASSES, Finding
from shardverify.features.report.draw import bar
from shardverify.features.report.page import Page, Section, details, table, text

__all__ = ["dtensor_page", "OUTCOME_COLOURS"]

OUTCOME_COLOURS = {"agrees": "#1a7f37", "silent-wrong": "#cf222e", "late-failure": "#bc4c00", "raises": "#bf8700",
                   "missed-optimisation": "#8250df", "not-expressible": "#8c959f", "not-simulated": "#afb8c1",
                   "too-slow": "#57606a"}
#: the classes a reader must see (wrong results), in the order shown
_WRONG = ("silent-wrong", "late-failure")


def _anchor(key: str) -> str:
    return "class-" + "".join(c if c.isalnum() else "-" for c in key)


def _matrix(results: Sequence[CaseResult], keys_of: dict[tuple, list[str]]) -> str:
    """Cases by outcome: a row per (op, case, mesh), a column per outcome, the count coloured."""
    classes = [k for k in CLASSES if any(r.counts.get(k) for r in results)]
    head = "".join(f'<th class="num"><span class="swatch" style="background:{OUTCOME_COLOURS.get(k, "#999")}">'
                   f'</span>{text(k)}</th>' for k in classes)
    body = []
    for result in results:
        cells = []
        for klass in classes:
            count = result.counts.get(klass, 0)
            if not count:
                cells.append('<td class="num muted">.</td>')
                continue
            style = f'style="color:{OUTCOME_COLOURS.get(klass, "#000")};font-weight:600"'
            keys = keys_of.get((result.op, result.case, tuple(result.mesh), klass), [])
            links = " ".join(f'<a href="#{_anchor(k)}">{i + 1}</a>' for i, k in enumerate(dict.fromkeys(keys)))
            cells.append(f'<td class="num" {style}>{count}{(" " + links) if links and klass in _WRONG else ""}</td>')
        parts = [(k, result.counts.get(k, 0), OUTCOME_COLOURS.get(k, "#999")) for k in classes]
        wrong = any(result.counts.get(k) for k in _WRONG)
        body.append(f'<tr{" class=bad" if wrong else ""}><td>{text(result.op)}</td><td class="mono">'
                    f'{text(result.case)}</td><td>{text(list(result.mesh))}</td>{"".join(cells)}'
                    f'<td>{bar(parts, 160)}</td></tr>')
    return (f"<table><thead><tr><th>op</th><th>case</th><th>mesh</th>{head}<th>share</th></tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>"
            '<p class="muted">A number beside a count links its class of wrong results below.</p>')


def _accepted(findings: list[Finding], accepted: Accepted) -> bool:
    """Whether the class fails no run: the accepted file lists each of its findings with its culprit
    and severity, or the finding is no corruption (rounding within a few ulps of its dtype)."""
    return all(not is_corruption(f) or accepted.accepts(f.key(), culprit_of(f), severity_of(f)) for f in findings)


def _severities(findings: list[Finding]) -> str:
    counts = Counter(severity_of(f) for f in findings)
    return ", ".join(f"{k} ({counts[k]})" for k in SEVERITIES if counts.get(k))


def _class_body(findings: list[Finding], reason: str | None, accepted: Accepted) -> str:
    first = findings[0]
    if reason is not None and _accepted(findings, accepted):
        state = f'<p><span class="tag pass">accepted</span> {text(reason)}</p>'
    elif not any(is_corruption(f) for f in findings):
        state = ('<p><span class="tag pass">rounding</span> within a few ulps of its low-precision dtype: '
                 'not counted as corruption</p>')
    elif reason is not None:
        state = ('<p><span class="tag fail">new</span> listed in the accepted file, but not with this culprit or '
                 'severity: a second fault under a known key fails the run</p>')
    else:
        state = '<p><span class="tag fail">new</span> not in the accepted file: this class fails the run</p>'
    cause = accepted.cause(first.key())
    listed = f" (its entry lists: {', '.join(cause.severity)})" if cause is not None and cause.severity else ""
    state += f"<p><b>severity</b>: {text(_severities(findings) + listed)}</p>"
    if cause is not None and cause.slug:
        state += f"<p><b>root cause</b>: {text(cause.slug)}</p>"
    rows = [(f.case, list(f.mesh), f.line, f.detail) for f in findings[:40]]
    more = f'<p class="muted">and {len(findings) - 40} more combinations</p>' if len(findings) > 40 else ""
    facts = [("DTensor's rule", first.rule), ("what the runtime did", first.runtime), ("culprit", first.culprit),
             ("collectives", first.comms), ("a local strategy", first.local_strategy)]
    said = "".join(f"<p><b>{text(k)}</b>: {text(v)}</p>" for k, v in facts if v)
    if not first.culprit and culprit_of(first):
        said += f"<p><b>culprit</b>: {text(culprit_of(first))}</p>"
    repro = next((f.repro for f in findings if f.repro), "")
    script = (details("repro: a standalone script", f"<pre>{text(repro)}</pre>", open_=False) if repro else
              '<p class="muted">No repro script with these results (a run with --repros DIR writes them).</p>')
    return state + said + table(("case", "mesh", "placements", "what differs"), rows) + more + script


def _causes(classes: dict[str, list[Finding]], accepted: Accepted) -> str:
    """The root causes of the classes found: each one's severity as its entry lists it, its
    classes and combinations by severity found, its page; the classes no entry lists last."""
    grouped: dict[str, list[list[Finding]]] = {}
    for key, findings in sorted(classes.items()):
        cause = accepted.cause(key)
        grouped.setdefault((cause.slug or cause.reason[:60]) if cause is not None else "", []).append(findings)
    rows, bad = [], []
    order = [(c.slug or c.reason[:60], c) for c in accepted.causes] + [("", None)]
    for name, cause in order:
        found = grouped.get(name, [])
        if not found:
            continue
        counts = Counter(severity_of(f) for findings in found for f in findings)
        rows.append((name or "not in the accepted file", ", ".join(cause.severity) if cause is not None else "",
                     len(found), sum(len(findings) for findings in found), *(counts.get(k, 0) for k in SEVERITIES),
                     cause.page if cause is not None else ""))
        bad.append(cause is None)
    return table(("root cause", "severity (accepted)", "classes", "combinations", *SEVERITIES, "page"), rows,
                 numeric=frozenset(range(2, 4 + len(SEVERITIES))), bad=bad)


def dtensor_page(results: Sequence[CaseResult], accepted: Accepted, passed: bool, seconds: float,
                 command: str, title: str = "shardverify dtensor") -> Page:
    """The page of a run's ``results`` against ``accepted``."""
    executed = sum(r.executed for r in results)
    totals = {k: sum(r.counts.get(k, 0) for r in results) for k in CLASSES}
    classes: dict[str, list[Finding]] = {}
    keys_of: dict[tuple, list[str]] = {}
    for result in results:
        for finding in result.findings:
            if finding.klass in _WRONG:
                classes.setdefault(finding.key(), []).append(finding)
                keys_of.setdefault((result.op, result.case, tuple(result.mesh), finding.klass), []).append(finding.key())
    new = [k for k in classes if not _accepted(classes[k], accepted)]
    summary = (f"{executed:,} layout combinations executed on DTensor: {totals['agrees']:,} agree, "
               f"{totals['silent-wrong']:,} silently wrong, {totals['late-failure']:,} fail later, "
               f"{totals['raises']:,} raise",
               f"{len(classes)} class(es) of wrong results, {len(new)} not in the accepted file",
               f"{len(results)} case x mesh row(s), {seconds:.1f} s: {command}")
    culprit = ""
    if new:
        first = classes[new[0]][0]
        culprit = f"new class {new[0]}: {first.case} on mesh {list(first.mesh)}: {first.detail}"
    sections = [Section("Outcomes by case and mesh", _matrix(results, keys_of), "matrix")]
    if classes:
        sections.append(Section("Root causes and severity", _causes(classes, accepted), "causes"))
    cards = []
    for key, findings in sorted(classes.items(), key=lambda item: (item[0] not in new, item[0])):
        reason, ok = accepted.reason(key), key not in new
        cards.append(f'<div id="{_anchor(key)}">' + details(
            f"{key}: {len(findings)} combination(s), {_severities(findings)}{'' if ok else ' (new)'}",
            _class_body(findings, reason, accepted), open_=not ok) + "</div>")
    if cards:
        sections.append(Section(f"Classes of wrong results ({len(classes)})", "".join(cards), "classes"))
    legend = table(("outcome", "meaning", "combinations"), [(k, v, totals[k]) for k, v in CLASSES.items()],
                   numeric=frozenset({2}))
    sections.append(Section("What the outcomes mean", legend, "outcomes"))
    return Page(title, passed, summary, tuple(sections), culprit)
