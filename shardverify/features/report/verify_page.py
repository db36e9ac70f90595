"""The page of a `shardverify verify` run: the verdict, each failing strategy with its layouts
and every rank's error drawn over the tensor, then every (case, mesh) row."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from shardverify.features.report.draw import heat_figure, heat_legend
from shardverify.features.report.layouts import rank_legend, strategy_figures
from shardverify.features.report.page import Page, Section, details, table, text
from shardverify.verify.report import CheckResult, Mismatch

__all__ = ["VerifiedRow", "verify_page", "MOST_DRAWN"]

#: failing strategies drawn in full; the others are listed in words
MOST_DRAWN = 40


class VerifiedRow(Protocol):
    """One (case, mesh) of a verify run, as the command keeps it."""

    op: str
    case: str
    mesh: tuple[int, ...]
    verified: int
    failures: int
    seconds: float
    error: str
    warning: str
    results: list


def _figures(m: Mismatch) -> str:
    if m.kind == "values" and m.max_abs_err is not None and not m.detail:
        return f"max abs {m.max_abs_err:.3g}, max rel {m.max_rel_err:.3g} (rtol {m.rtol:.3g}, atol {m.atol:.3g})"
    if m.kind == "shape":
        return f"local shape {m.actual_shape}, expected {m.expected_shape}"
    return m.detail


def failure_body(result: CheckResult, draw: bool) -> str:
    """A failing strategy: what is wrong on which rank, its layouts, and each rank's error map."""
    parts = [f'<p class="mono">{text(result.case)}</p>']
    if result.note:
        parts.append(f'<p class="muted">{text(result.note)}</p>')
    rows = [(("every rank" if m.rank < 0 else m.rank), m.tensor, m.kind, _figures(m)) for m in result.mismatches]
    found = table(("rank", "tensor", "what", "figures"), rows)
    if not draw:
        return "".join(parts) + found
    if result.checked is not None:
        parts.append("<h3>Layouts</h3>" + rank_legend(math.prod(result.mesh_shape)) + strategy_figures(result.checked))
    maps = [m.error_map for m in result.mismatches if m.error_map is not None]
    if maps:
        parts.append("<h3>Where the values are wrong</h3>" + heat_legend()
                     + '<div class="figures">' + "".join(heat_figure(e) for e in maps) + "</div>")
    elif any(m.kind == "values" for m in result.mismatches):
        parts.append('<p class="muted">No error map: the values were compared in another process '
                     '(a process backend or an isolated check).</p>')
    return "".join(parts) + "<h3>What differs</h3>" + found


def verify_page(rows: Sequence[VerifiedRow], backend: str, seconds: float, title: str = "shardverify verify") -> Page:
    """The page of a run over ``rows`` on ``backend`` taking ``seconds``."""
    results = [r for row in rows for r in row.results]
    failed = [r for r in results if not r.passed]
    broken = [row for row in rows if row.error]
    passed = not failed and not broken and bool(results)
    ops = sorted({row.op for row in rows})
    meshes = sorted({tuple(row.mesh) for row in rows})
    summary = (f"{len(results):,} strategy checks, {len(failed):,} failed"
               + (f", {len(broken)} case(s) could not run" if broken else ""),
               f"{len(ops)} op(s), {len(rows)} case x mesh row(s), meshes {', '.join(str(list(m)) for m in meshes)}",
               f"{backend} backend, {seconds:.1f} s")
    culprit = ""
    if failed:
        first = failed[0]
        culprit = first.headline + "\n" + "\n".join("    " + m.describe() for m in first.mismatches[:3])
    elif broken:
        culprit = f"{broken[0].op} {broken[0].case} on mesh {list(broken[0].mesh)}: {broken[0].error}"
    sections = []
    if failed:
        cards = []
        for index, result in enumerate(failed):
            name = f"{result.op}: {result.strategy} on mesh {list(result.mesh_shape)}"
            cards.append(details(name, failure_body(result, index < MOST_DRAWN), open_=index < 3))
        more = (f'<p class="muted">The first {MOST_DRAWN} are drawn; the rest are listed in words.</p>'
                if len(failed) > MOST_DRAWN else "")
        sections.append(Section(f"Failing strategies ({len(failed)})", more + "".join(cards), "failures"))
    if broken:
        sections.append(Section(f"Cases that could not run ({len(broken)})",
                                table(("op", "case", "mesh", "error"),
                                      [(row.op, row.case, list(row.mesh), row.error) for row in broken]), "errors"))
    table_rows = [(row.op, row.case, list(row.mesh), row.verified, row.failures, f"{row.seconds:.2f}",
                   row.warning and "no sharding to check: only the replicated strategy exists")
                  for row in rows]
    sections.append(Section("Every case and mesh", table(
        ("op", "case", "mesh", "strategies", "failures", "seconds", "note"), table_rows,
        numeric=frozenset({3, 4, 5}), bad=[row.failures > 0 for row in rows]), "rows"))
    return Page(title, passed, summary, tuple(sections), culprit)
