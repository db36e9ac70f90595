"""Drawings as inline SVG: a layout as the tensor cut into blocks coloured by rank, a rank's
error as a heat map over the tensor, a plan as the model's graph, a count as a bar.

A tensor is drawn as 2-D panels of its last two dims. A layout cuts them where some rank's block
starts or ends, each block as wide and tall as its elements; an error map is drawn on the grid of
:mod:`shardverify.verify.error_map`. Colours: one per rank (a block held by several ranks takes its
first rank's colour and is labelled with all of them), grey for a block every rank holds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardverify.features.report.page import text
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.verify.error_map import MAX_PANELS, ErrorMap, Panels

__all__ = ["rank_colour", "EVERY_RANK", "layout_figure", "heat_figure", "heat_legend", "GraphNode", "GraphEdge",
           "graph_figure", "bar"]

_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
            "#9c755f", "#86bcb6", "#d37295", "#a0cbe8")
EVERY_RANK = "#d0d7de"
_NOT_HELD = "#eef1f4"
_MOST_WIDTH = 300     # px of one panel's cells
_MOST_HEIGHT = 160
_ACROSS = 3           # panels side by side


def rank_colour(rank: int) -> str:
    """Rank ``rank``'s colour (a fixed palette, then hues around the wheel)."""
    if rank < len(_PALETTE):
        return _PALETTE[rank]
    return f"hsl({(rank * 137.508) % 360:.0f}, 55%, 55%)"


def _cell_size(grid: Panels) -> float:
    return max(4.0, min(18.0, _MOST_WIDTH / len(grid.col_cells), _MOST_HEIGHT / len(grid.row_cells)))


def _panel_title(grid: Panels, number: int) -> str:
    if len(grid.shape) <= 2:
        return ""
    return "[" + ", ".join([str(i) for i in grid.index(number)] + [":", ":"]) + "]"


def _figure(svg: str, caption: str) -> str:
    return f'<div class="figure">{svg}<div class="caption">{caption}</div></div>'


def _panels_svg(grid: Panels, fill, titles=None) -> tuple[str, int, int]:
    """The SVG body of every chosen panel side by side (wrapping after _ACROSS): ``fill(p, i, j)``
    gives the colour of cell (i, j) of the p-th chosen panel, ``titles`` its tooltip or None.
    Returns (body, width, height)."""
    size = _cell_size(grid)
    width, height = len(grid.col_cells) * size, len(grid.row_cells) * size
    top = 16 if len(grid.shape) > 2 else 2
    parts, across = [], min(_ACROSS, len(grid.chosen))
    for p, number in enumerate(grid.chosen):
        x0 = 2 + (p % across) * (width + 14)
        y0 = top + (p // across) * (height + top + 8)
        title = _panel_title(grid, number)
        if title:
            parts.append(f'<text x="{x0:.1f}" y="{y0 - 4:.1f}" font-size="11" fill="#59636e" '
                         f'font-family="monospace">{text(title)}</text>')
        for i in range(len(grid.row_cells)):
            for j in range(len(grid.col_cells)):
                tip = titles(p, i, j) if titles else None
                tip = f"<title>{text(tip)}</title>" if tip else ""
                parts.append(f'<rect class="c" x="{x0 + j * size:.1f}" y="{y0 + i * size:.1f}" '
                             f'width="{size:.1f}" height="{size:.1f}" fill="{fill(p, i, j)}">{tip}</rect>')
        parts.append(f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{width:.1f}" height="{height:.1f}" fill="none" '
                     f'stroke="#59636e" stroke-width="1"/>')
    rows = math.ceil(len(grid.chosen) / across)
    style = "<style>.c{stroke:#fff;stroke-width:.6}</style>"
    return style + "".join(parts), int(4 + across * (width + 14)), int(top + rows * (height + top + 8))


def _owners(spec: ShardingSpec) -> tuple[list[tuple[tuple[int, int], ...]], int]:
    """Each rank's block as (start, stop) per dim, and the number of ranks."""
    mesh = DeviceMesh(spec.mesh_shape)
    count = math.prod(spec.mesh_shape)
    blocks = []
    for rank in range(count):
        found = []
        for sl, size in zip(spec.local_slices(mesh, rank), spec.tensor_shape):
            start, stop, _ = sl.indices(size)
            found.append((start, stop))
        blocks.append(tuple(found))
    return blocks, count


def _holders(blocks, index: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(r for r, block in enumerate(blocks) if all(a <= i < b for (a, b), i in zip(block, index)))


def _runs(blocks, dim: int, size: int) -> list[tuple[int, int]]:
    """Dim ``dim`` (of ``size`` elements) cut where some rank's block starts or ends."""
    cuts = sorted({0, size} | {edge for block in blocks for edge in block[dim] if 0 < edge < size})
    return list(zip(cuts, cuts[1:])) or [(0, size)]


def _range_text(run: tuple[int, int], size: int) -> str:
    return ":" if run == (0, size) else str(run[0]) if run[1] - run[0] == 1 else f"{run[0]}:{run[1]}"


def layout_figure(name: str, spec: ShardingSpec, *, partial: str = "") -> str:
    """``name``'s layout ``spec`` drawn: the tensor's blocks coloured by the ranks holding them,
    each as wide and tall as its elements. The dims before the last two are drawn as one panel per
    run of indices held alike (``[0:2, :, :]``), so every block shows. ``partial``: how the tensor
    is held as partial values ("a partial sum over mesh axis 0"), marked with hatching."""
    blocks, count = _owners(spec)
    shape = spec.tensor_shape
    rows, cols = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[0] if shape else 1)
    lead = len(shape) - 2
    row_runs = _runs(blocks, lead, rows) if len(shape) >= 2 else [(0, 1)]
    col_runs = _runs(blocks, len(shape) - 1, cols) if shape else [(0, 1)]
    lead_runs = list(itertools.product(*(_runs(blocks, d, shape[d]) for d in range(max(lead, 0)))))
    shown = lead_runs[:MAX_PANELS]
    width = max(60.0, min(300.0, cols * 10.0))
    height = max(16.0, min(150.0, rows * 10.0)) if len(shape) >= 2 else 16.0
    top = 16 if lead > 0 else 2
    across = min(_ACROSS, len(shown))
    parts = ["<style>.c{stroke:#fff;stroke-width:1.5}</style>"]
    for p, runs in enumerate(shown):
        x0 = 2 + (p % across) * (width + 14)
        y0 = top + (p // across) * (height + top + 8)
        if lead > 0:
            title = "[" + ", ".join([_range_text(r, shape[d]) for d, r in enumerate(runs)] + [":", ":"]) + "]"
            parts.append(f'<text x="{x0:.1f}" y="{y0 - 4:.1f}" font-size="11" fill="#59636e" '
                         f'font-family="monospace">{text(title)}</text>')
        for r0, r1 in row_runs:
            for c0, c1 in col_runs:
                index = tuple(r[0] for r in runs) + ((r0, c0) if len(shape) >= 2 else (c0,) if shape else ())
                ranks = _holders(blocks, index)
                x, w = x0 + width * c0 / cols, width * (c1 - c0) / cols
                y, h = y0 + height * r0 / rows, height * (r1 - r0) / rows
                every = len(ranks) == count and count > 1
                colour = EVERY_RANK if every else rank_colour(ranks[0]) if ranks else "#fff"
                who = "every rank" if every else "rank " + ", ".join(map(str, ranks))
                parts.append(f'<rect class="c" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
                             f'fill="{colour}"><title>{text(who)}</title></rect>')
                words = "" if every else ",".join(map(str, ranks))
                if words and w >= 7 * len(words) + 4 and h >= 12:
                    parts.append(f'<text x="{x + 3:.1f}" y="{y + min(h, 24) / 2 + 4:.1f}" font-size="11" '
                                 f'fill="#fff" font-weight="600" font-family="sans-serif">{text(words)}</text>')
        parts.append(f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{width:.1f}" height="{height:.1f}" fill="none" '
                     f'stroke="#59636e" stroke-width="1"/>')
    total_w = int(4 + across * (width + 14))
    total_h = int(math.ceil(len(shown) / across) * (height + top + 8) - 4)
    if partial:
        parts.append('<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
                     'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" stroke="#000" '
                     'stroke-opacity=".35" stroke-width="2"/></pattern></defs>'
                     f'<rect x="0" y="0" width="{total_w}" height="{total_h}" fill="url(#hatch)"/>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" role="img" '
           f'aria-label="layout of {text(name)}">{"".join(parts)}</svg>')
    more = "" if len(lead_runs) <= len(shown) else f"; {len(shown)} of its {len(lead_runs)} panels shown"
    caption = (f"<b>{text(name)}</b> {text(list(shape))} laid out as <code>{text(spec)}</code> "
               f"on mesh {text(list(spec.mesh_shape))}{text(more)}")
    if partial:
        caption += f"; hatched: {text(partial)}"
    return _figure(svg, caption)


def _heat(ratio: float) -> str:
    """The colour of an error ``ratio`` (error over the error allowed): greens within tolerance,
    yellow to deep red over it on a log scale, black for a NaN or inf where a number belongs."""
    if math.isnan(ratio):
        return _NOT_HELD
    if math.isinf(ratio):
        return "#000000"
    if ratio <= 1.0:
        shade = int(218 - 70 * ratio)
        return f"rgb({shade - 40},{min(255, shade + 30)},{shade - 30})"
    level = min(1.0, math.log10(ratio) / 6)   # 1x .. 1e6x over
    red, green, blue = 255 - int(120 * level), int(210 * (1 - level) ** 1.4), int(60 * (1 - level))
    return f"rgb({red},{green},{blue})"


def heat_legend() -> str:
    """What the heat maps' colours mean."""
    stops = [("within tolerance", _heat(0.5)), ("just over", _heat(1.5)), ("1,000x over", _heat(1e3)),
             ("1,000,000x over", _heat(1e6)), ("NaN or inf", _heat(math.inf)), ("another rank's block", _NOT_HELD)]
    return '<div class="legend">' + "".join(
        f'<span><span class="swatch" style="background:{colour}"></span>{text(words)}</span>'
        for words, colour in stops) + "</div>"


def heat_figure(drawn: ErrorMap) -> str:
    """Rank ``drawn.rank``'s error in ``drawn.tensor``, each cell its worst element's error over
    the error its tolerance allows, placed where the rank's block sits in the whole tensor."""
    grid = drawn.grid
    per = grid.cells_per_panel
    cells = drawn.cells

    def fill(p, i, j):
        return _heat(cells[p * per + i * len(grid.col_cells) + j])

    def titles(p, i, j):
        ratio = cells[p * per + i * len(grid.col_cells) + j]
        return "not this rank's" if math.isnan(ratio) else f"{ratio:.3g} x the allowed error"

    body, width, height = _panels_svg(grid, fill, titles if per * len(grid.chosen) <= 1024 else None)
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           f'aria-label="error of rank {drawn.rank} in {text(drawn.tensor)}">{body}</svg>')
    worst = drawn.worst
    said = "no error" if math.isnan(worst) else f"worst {worst:.3g} x the allowed error"
    shown = "" if grid.total <= len(grid.chosen) else f"; the {len(grid.chosen)} of {grid.total} slices with its largest errors"
    return _figure(svg, f"<b>rank {drawn.rank}</b>: {text(drawn.tensor)} {text(list(drawn.shape))}, "
                        f"{text(said)}{text(shown)}")


@dataclass(frozen=True)
class GraphNode:
    name: str
    label: str          # second line: how it runs
    colour: str
    tip: str = ""


@dataclass(frozen=True)
class GraphEdge:
    """``how``: "moves" (a collective between devices), "local" (each device slices what it
    holds) or "" (the layout passes as it is)."""

    source: str
    target: str
    how: str
    tip: str = ""


def _layers(nodes: Sequence[GraphNode], edges: Sequence[GraphEdge]) -> dict[str, int]:
    """Each node's layer: one below the deepest node feeding it (nodes come in graph order); a
    node fed by none, one above its first consumer."""
    feeding: dict[str, list[str]] = {}
    for edge in edges:
        feeding.setdefault(edge.target, []).append(edge.source)
    layer: dict[str, int] = {}
    for node in nodes:
        layer[node.name] = 1 + max((layer[s] for s in feeding.get(node.name, ()) if s in layer), default=-1)
    consumers: dict[str, list[str]] = {}
    for edge in edges:
        consumers.setdefault(edge.source, []).append(edge.target)
    for node in nodes:   # a weight or an input sits just above its first use, not all in the top row
        if node.name not in feeding and consumers.get(node.name):
            layer[node.name] = max(0, min(layer[c] for c in consumers[node.name] if c in layer) - 1)
    return layer


_EDGE_STYLES = {"moves": ("#cf222e", "arrow-comm", 2.0), "local": ("#0969da", "arrow-local", 1.4),
                "": ("#8c959f", "arrow", 1.0)}


def graph_figure(nodes: Sequence[GraphNode], edges: Sequence[GraphEdge], caption: str) -> str:
    """The graph top to bottom, a row per layer; an edge that moves data between devices red, one
    where each device slices what it holds blue."""
    layer = _layers(nodes, edges)
    rows: dict[int, list[GraphNode]] = {}
    for node in nodes:
        rows.setdefault(layer[node.name], []).append(node)
    box_w, box_h, gap_x, gap_y = 150, 34, 16, 30
    across = max((len(r) for r in rows.values()), default=1)
    width = across * (box_w + gap_x) + gap_x
    where: dict[str, tuple[float, float]] = {}
    for depth, row in rows.items():
        offset = (width - len(row) * (box_w + gap_x) + gap_x) / 2
        for k, node in enumerate(row):
            where[node.name] = (offset + k * (box_w + gap_x), 10 + depth * (box_h + gap_y))
    height = 10 + (max(rows, default=0) + 1) * (box_h + gap_y)
    parts = ['<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" markerHeight="6" '
             'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#59636e"/></marker>'
             '<marker id="arrow-comm" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" markerHeight="6" '
             'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#cf222e"/></marker>'
             '<marker id="arrow-local" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" markerHeight="6" '
             'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#0969da"/></marker></defs>']
    for edge in edges:
        if edge.source not in where or edge.target not in where:
            continue
        (x1, y1), (x2, y2) = where[edge.source], where[edge.target]
        colour, marker, wide = _EDGE_STYLES.get(edge.how, _EDGE_STYLES[""])
        tip = f"<title>{text(edge.tip)}</title>" if edge.tip else ""
        parts.append(f'<path d="M{x1 + box_w / 2:.1f},{y1 + box_h:.1f} C{x1 + box_w / 2:.1f},{y1 + box_h + 20:.1f} '
                     f'{x2 + box_w / 2:.1f},{y2 - 20:.1f} {x2 + box_w / 2:.1f},{y2:.1f}" fill="none" '
                     f'stroke="{colour}" stroke-width="{wide}" marker-end="url(#{marker})">{tip}</path>')
    for node in nodes:
        x, y = where[node.name]
        tip = f"<title>{text(node.tip)}</title>" if node.tip else ""
        parts.append(f'<g>{tip}<rect x="{x:.1f}" y="{y:.1f}" width="{box_w}" height="{box_h}" rx="5" '
                     f'fill="{node.colour}" stroke="#59636e" stroke-width="0.8"/>'
                     f'<text x="{x + 6:.1f}" y="{y + 14:.1f}" font-size="11" font-weight="600" '
                     f'font-family="sans-serif">{text(_clip(node.name, 22))}</text>'
                     f'<text x="{x + 6:.1f}" y="{y + 27:.1f}" font-size="10" font-family="monospace">'
                     f'{text(_clip(node.label, 24))}</text></g>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" role="img" '
           f'aria-label="the model graph">{"".join(parts)}</svg>')
    return _figure(svg, caption)


def _clip(words: str, most: int) -> str:
    return words if len(words) <= most else words[:most - 1] + "\u2026"


def bar(parts: Sequence[tuple[str, int, str]], width: int = 220) -> str:
    """A stacked bar of counts: (name, count, colour) each, titled with its name and count."""
    total = sum(count for _, count, _ in parts) or 1
    x, rects = 0.0, []
    for name, count, colour in parts:
        w = width * count / total
        if w > 0:
            rects.append(f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="12" fill="{colour}">'
                         f'<title>{text(name)}: {count}</title></rect>')
            x += w
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="12">{"".join(rects)}</svg>'
