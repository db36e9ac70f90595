"""The Markdown the project's reports write (headings, paragraphs, bullet lists, pipe tables,
fenced code, inline code, bold and links), as HTML for a page. Text is escaped first: a
report's content never becomes markup of its own."""

from __future__ import annotations

import re

from shardverify.features.report.page import text

__all__ = ["markdown_html"]

_INLINE_CODE = re.compile(r"`([^`]+)`")
_BOLD = re.compile(r"\*\*([^*]+)\*\*")
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
_BULLET = re.compile(r"^\s*[-*]\s+")


def _inline(line: str) -> str:
    codes: list[str] = []

    def keep(match: re.Match) -> str:
        codes.append(f"<code>{text(match.group(1))}</code>")
        return f"\x00{len(codes) - 1}\x00"

    out = text(_INLINE_CODE.sub(keep, line))
    out = _BOLD.sub(r"<b>\1</b>", out)
    # a link stays a link only to a page's own anchors or a web address: never javascript: and the like
    out = _LINK.sub(lambda m: (f'<a href="{m.group(2)}">{m.group(1)}</a>'
                               if m.group(2).startswith(("#", "https://", "http://")) else m.group(0)), out)
    return re.sub("\x00(\\d+)\x00", lambda m: codes[int(m.group(1))], out)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def markdown_html(source: str) -> str:
    """``source`` as HTML."""
    lines, out, i = source.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            block = []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                block.append(lines[i])
                i += 1
            out.append(f"<pre>{text(chr(10).join(block))}</pre>")
            i += 1
            continue
        heading = re.match(r"(#{1,6})\s+(.*)", line)
        if heading:
            level = min(6, len(heading.group(1)) + 1)   # the page's own title is the h1
            out.append(f"<h{level}>{_inline(heading.group(2))}</h{level}>")
            i += 1
            continue
        if line.lstrip().startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\s*\|?[\s:|-]+\|?\s*", lines[i + 1]):
            head = "".join(f"<th>{_inline(c)}</th>" for c in _cells(line))
            rows = []
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in _cells(lines[i])) + "</tr>")
                i += 1
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")
            continue
        if re.match(r"\s*[-*]\s+", line):
            items = []
            while i < len(lines) and re.match(r"\s*[-*]\s+", lines[i]):
                items.append("<li>" + _inline(_BULLET.sub("", lines[i])) + "</li>")
                i += 1
            out.append(f"<ul>{''.join(items)}</ul>")
            continue
        if not line.strip():
            i += 1
            continue
        paragraph = []
        while i < len(lines) and lines[i].strip() and not lines[i].startswith(("#", "```", "|")) \
                and not re.match(r"\s*[-*]\s+", lines[i]):
            paragraph.append(lines[i])
            i += 1
        out.append(f"<p>{_inline(' '.join(paragraph))}</p>")
    return "".join(out)
