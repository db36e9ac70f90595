"""The page of a `shardverify dtensor` run: the verdict, a matrix of cases by outcome, then each
class of wrong results with its combinations, DTensor's rule, the culprit and its repro."""

from __future__ import annotations

from collections.abc import Sequence

from shardverify.dtensor.accepted import Accepted
from shardverify.dtensor.run import CaseResult
from shardverify.dtensor.verdicts import CLASSES, Finding
from shardverify.report.draw import bar
from shardverify.report.page import Page, Section, details, table, text

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


def _class_body(findings: list[Finding], reason: str | None) -> str:
    first = findings[0]
    state = (f'<p><span class="tag pass">accepted</span> {text(reason)}</p>' if reason is not None else
             '<p><span class="tag fail">new</span> not in the accepted file: this class fails the run</p>')
    rows = [(f.case, list(f.mesh), f.line, f.detail) for f in findings[:40]]
    more = f'<p class="muted">and {len(findings) - 40} more combinations</p>' if len(findings) > 40 else ""
    facts = [("DTensor's rule", first.rule), ("what the runtime did", first.runtime), ("culprit", first.culprit),
             ("collectives", first.comms), ("a local strategy", first.local_strategy)]
    said = "".join(f"<p><b>{text(k)}</b>: {text(v)}</p>" for k, v in facts if v)
    repro = next((f.repro for f in findings if f.repro), "")
    script = (details("repro: a standalone script", f"<pre>{text(repro)}</pre>", open_=False) if repro else
              '<p class="muted">No repro script with these results (a run with --repros DIR writes them).</p>')
    return state + said + table(("case", "mesh", "placements", "what differs"), rows) + more + script


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
    new = [k for k in classes if accepted.reason(k) is None]
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
    cards = []
    for key, findings in sorted(classes.items(), key=lambda item: (accepted.reason(item[0]) is not None, item[0])):
        reason = accepted.reason(key)
        cards.append(f'<div id="{_anchor(key)}">' + details(
            f"{key}: {len(findings)} combination(s){'' if reason is not None else ' (new)'}",
            _class_body(findings, reason), open_=reason is None) + "</div>")
    if cards:
        sections.append(Section(f"Classes of wrong results ({len(classes)})", "".join(cards), "classes"))
    legend = table(("outcome", "meaning", "combinations"), [(k, v, totals[k]) for k, v in CLASSES.items()],
                   numeric=frozenset({2}))
    sections.append(Section("What the outcomes mean", legend, "outcomes"))
    return Page(title, passed, summary, tuple(sections), culprit)
