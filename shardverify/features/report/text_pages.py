"""The pages of the commands whose detail is already a written report: `audit` (its Markdown
report under the verdict, offered layouts against valid ones drawn as bars) and `parallelize`
(each run of a shipped plan, its verdict and evidence)."""

from __future__ import annotations

from collections.abc import Sequence

from shardverify.features.report.draw import bar
from shardverify.features.report.markdown import markdown_html
from shardverify.features.report.page import Page, Section, details, table, text

__all__ = ["audit_page", "parallelize_page"]


def audit_page(rows: Sequence, summary: Sequence[str], markdown: str, passed: bool,
               title: str = "shardverify audit") -> Page:
    """``rows``: the audit's rows (audit.run); ``summary``: its verdict lines as the terminal
    shows them, the first one the verdict; ``markdown``: its written report."""
    bars = []
    for row in rows:
        parts = [("covered by a strategy", row.covered, "#1a7f37"), ("missing", len(row.missing), "#cf222e"),
                 ("accepted gaps", len(row.accepted), "#8c959f"), ("incorrect", len(row.incorrect), "#bc4c00")]
        bars.append(f'<tr{" class=bad" if row.failed else ""}><td>{text(row.op)}</td><td class="mono">'
                    f'{text(row.case)}</td><td>{text(list(row.mesh))}</td><td class="num">{row.valid}</td>'
                    f'<td class="num">{row.covered}</td><td class="num">{len(row.missing)}</td>'
                    f'<td class="num">{len(row.incorrect)}</td><td>{bar(parts, 160)}</td></tr>')
    legend = ('<div class="legend"><span><span class="swatch" style="background:#1a7f37"></span>covered</span>'
              '<span><span class="swatch" style="background:#cf222e"></span>missing</span>'
              '<span><span class="swatch" style="background:#8c959f"></span>accepted gaps</span>'
              '<span><span class="swatch" style="background:#bc4c00"></span>incorrect</span></div>')
    cases = (legend + "<table><thead><tr><th>op</th><th>case</th><th>mesh</th><th class=num>valid layouts</th>"
             "<th class=num>covered</th><th class=num>missing</th><th class=num>incorrect</th><th>share</th></tr>"
             f"</thead><tbody>{''.join(bars)}</tbody></table>")
    lines = list(summary)
    sections = (Section("Every case and mesh", cases, "cases"), Section("The report", markdown_html(markdown), "report"))
    return Page(title, passed, tuple(lines[:4]), sections, "\n".join(lines[4:]) if not passed else "")


def parallelize_page(results: Sequence, passed: bool, headline: Sequence[str], runs: Sequence[tuple[str, str]],
                     title: str = "shardverify parallelize") -> Page:
    """``results``: the runs' JSON documents (parallelize.report.as_json); ``headline``: the verdict
    lines the terminal shows; ``runs``: (title, full text) of each run."""
    rows = [(r["model"], r["plan"], r["mesh"], r["mode"], r["verdict"], r["compared"], r["outside_budget"])
            for r in results]
    table_html = table(("model", "plan", "mesh", "mode", "verdict", "values compared", "outside budget"), rows,
                       numeric=frozenset({5, 6}), bad=[r["verdict"] != "right" for r in results])
    cards = "".join(details(name, f"<pre>{text(body)}</pre>", open_=i == 0) for i, (name, body) in enumerate(runs))
    lines = list(headline)
    return Page(title, passed, tuple(lines[:3]), (Section("Runs", table_html, "runs"), Section("Evidence", cards)),
                "\n".join(lines[3:]) if not passed else "")
