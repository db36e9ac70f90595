"""One self-contained HTML page: the verdict first, then sections a reader opens as needed.

Everything is inline (styles, drawings as SVG, no script, no font or image fetched), so the
file opens in any browser, offline, mailed or archived as one file. Every piece of text from a
run (op names, cases, messages) goes through :func:`text`: a name is data, never markup.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from shardverify.files import write_file_atomic

__all__ = ["Section", "Page", "text", "table", "details", "render", "write"]

_STYLE = """
:root { --pass: #1a7f37; --fail: #cf222e; --ink: #1f2328; --muted: #59636e; --line: #d1d9e0;
        --panel: #f6f8fa; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: var(--ink); margin: 0; background: #fff; }
header { padding: 18px 28px 14px; border-bottom: 1px solid var(--line); }
header h1 { font-size: 20px; margin: 0 0 8px; font-weight: 600; }
.verdict { display: inline-block; font-weight: 700; font-size: 15px; padding: 3px 12px;
           border-radius: 14px; color: #fff; margin-right: 10px; letter-spacing: .04em; }
.verdict.pass { background: var(--pass); } .verdict.fail { background: var(--fail); }
.verdict.none { background: var(--muted); }
.summary { margin: 8px 0 0; padding: 0; list-style: none; color: var(--ink); }
.summary li { margin: 2px 0; }
.culprit { margin-top: 10px; padding: 8px 12px; border-left: 4px solid var(--fail);
           background: #fff5f5; font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12.5px;
           white-space: pre-wrap; }
main { padding: 8px 28px 40px; }
section { margin-top: 22px; }
section > h2 { font-size: 16px; margin: 0 0 8px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
h3 { font-size: 14px; margin: 14px 0 6px; }
table { border-collapse: collapse; margin: 6px 0; font-size: 13px; }
th, td { padding: 4px 10px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; }
th { background: var(--panel); font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.bad td { background: #fff5f5; }
code, .mono { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12.5px; }
details { margin: 6px 0; border: 1px solid var(--line); border-radius: 6px; padding: 4px 10px; }
details > summary { cursor: pointer; font-weight: 600; }
details[open] > summary { margin-bottom: 6px; }
.figures { display: flex; flex-wrap: wrap; gap: 14px; align-items: flex-start; }
.figure { border: 1px solid var(--line); border-radius: 6px; padding: 6px 8px; background: #fff;
          max-width: 100%; overflow-x: auto; }
.figure .caption { font-size: 12px; color: var(--muted); margin-top: 2px; max-width: 520px; }
.legend { display: flex; flex-wrap: wrap; gap: 10px; font-size: 12px; color: var(--muted); margin: 4px 0; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px; vertical-align: -2px;
          margin-right: 4px; border: 1px solid rgba(0,0,0,.15); }
.muted { color: var(--muted); }
.tag { display: inline-block; padding: 0 6px; border-radius: 8px; font-size: 12px; background: var(--panel);
       border: 1px solid var(--line); }
.tag.fail { background: #ffebe9; border-color: #ffcecb; color: var(--fail); }
.tag.pass { background: #dafbe1; border-color: #aceebb; color: var(--pass); }
pre { background: var(--panel); padding: 8px 10px; border-radius: 6px; overflow-x: auto; font-size: 12.5px;
      white-space: pre-wrap; }
"""


@dataclass(frozen=True)
class Section:
    """A titled part of the page; ``body`` is HTML built with this module's helpers."""

    title: str
    body: str
    anchor: str = ""


@dataclass(frozen=True)
class Page:
    """``passed``: the verdict (None: a page with no verdict to give); ``summary``: the counts, one
    line each, shown under it; ``culprit``: the first thing wrong, shown first."""

    title: str
    passed: bool | None
    summary: tuple[str, ...]
    sections: tuple[Section, ...]
    culprit: str = ""


def text(value: object) -> str:
    """``value`` as text in HTML: escaped, quotes included."""
    return html.escape(str(value), quote=True)


def table(headers: tuple[str, ...], rows: list[tuple], *, numeric: frozenset[int] = frozenset(),
          bad: list[bool] | None = None) -> str:
    """A table of plain values (escaped); ``numeric``: the columns aligned right; ``bad``: rows
    marked as failing."""
    head = "".join(f'<th class="num">{text(h)}</th>' if i in numeric else f"<th>{text(h)}</th>"
                   for i, h in enumerate(headers))
    body = []
    for index, row in enumerate(rows):
        cells = "".join(f'<td class="num">{text(v)}</td>' if i in numeric else f"<td>{text(v)}</td>"
                        for i, v in enumerate(row))
        marked = ' class="bad"' if bad is not None and bad[index] else ""
        body.append(f"<tr{marked}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def details(summary: str, body: str, *, open_: bool = False) -> str:
    """A part the reader opens: ``summary`` is plain text, ``body`` HTML."""
    return f"<details{' open' if open_ else ''}><summary>{text(summary)}</summary>{body}</details>"


def anchor(section: Section) -> str:
    return f' id="{text(section.anchor)}"' if section.anchor else ""


def render(page: Page) -> str:
    """The whole document."""
    verdict = {True: ('pass', 'PASS'), False: ('fail', 'FAIL'), None: ('none', 'REPORT')}[page.passed]
    summary = "".join(f"<li>{text(line)}</li>" for line in page.summary)
    culprit = f'<div class="culprit">{text(page.culprit)}</div>' if page.culprit else ""
    sections = "".join(
        f'<section{anchor(s)}><h2>{text(s.title)}</h2>{s.body}</section>'
        for s in page.sections)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{text(page.title)}</title><style>{_STYLE}</style></head><body>"
            f"<header><h1>{text(page.title)}</h1><span class=\"verdict {verdict[0]}\">{verdict[1]}</span>"
            f"<ul class=\"summary\">{summary}</ul>{culprit}</header><main>{sections}</main></body></html>\n")


def write(page: Page, path: str) -> None:
    """The page written to ``path`` whole or not at all (files.write_file_atomic)."""
    write_file_atomic(path, render(page))
