"""The page of a `shardverify plan` check: the verdict, the model's graph coloured by how each
node is sharded with the edges that move data red, the coverage counts, then every node's
strategy and the layouts of the sharded ones."""

from __future__ import annotations

import math

from collections.abc import Sequence

from shardverify.plan.model import NodePlan, Plan
from shardverify.plan.verify import PlanResult
from shardverify.features.report.draw import GraphEdge, GraphNode, graph_figure
from shardverify.features.report.layouts import rank_legend, strategy_figures
from shardverify.features.report.page import Page, Section, details, table, text
from shardverify.sharding.strategy import OperationDataType

__all__ = ["plan_page", "MOST_DRAWN", "how_sharded"]

#: sharded nodes whose layouts are drawn; the others are listed in words
MOST_DRAWN = 30

_KIND_COLOURS = {"replicated": "#eaeef2", "not planned": "#ffffff", "partial": "#d8b9ff"}
#: resharding steps each device does on what it holds, moving nothing between devices
_LOCAL_STEPS = {"split", "zero_partial"}
_AXES_COLOURS = ("#a8c8ee", "#f9c59a", "#b5dfa6", "#f2b0b1", "#bde3df")


def how_sharded(item: NodePlan) -> tuple[str, str]:
    """(words, colour) for how ``item``'s output is laid out: replicated, sharded over which mesh
    axes, or left partial (its reduction deferred)."""
    if item.strategy is None:
        return "replicated (runs on whole tensors)", _KIND_COLOURS["replicated"]
    if item.deferred:
        return f"partial over mesh axes {list(item.deferred)}", _KIND_COLOURS["partial"]
    outputs = [spec for (name, spec), data in zip(item.strategy.sharding_specs, item.strategy.operands)
               if data.type is OperationDataType.OUTPUT]
    axes = sorted({a for spec in outputs for _, used in spec.dim_partition for a in used})
    if not axes:
        inputs_sharded = any(spec.dim_partition for spec in (s for _, s in item.strategy.sharding_specs))
        if inputs_sharded:
            return "output replicated (inputs sharded)", "#dde7f3"
        return "replicated", _KIND_COLOURS["replicated"]
    colour = _AXES_COLOURS[min(len(_AXES_COLOURS) - 1, sum(1 << a for a in axes) - 1)]
    return f"sharded over mesh axes {axes}", colour


def _output_words(item: NodePlan) -> str:
    if item.strategy is None:
        return "replicated"
    return item.strategy.name.split(" = ")[0] if " = " in item.strategy.name else item.strategy.name


def _graph(plan: Plan, failing: set[str]) -> str:
    nodes, edges = [], []
    for item in plan.nodes:
        words, colour = how_sharded(item)
        label = _output_words(item)
        nodes.append(GraphNode(item.node, label, "#ffd8d3" if item.node in failing else colour,
                               f"{item.node}: {item.strategy_name}; {words}"))
        for reshard in item.reshards:
            kinds = {step.kind for step in reshard.steps}
            how = "moves" if kinds - _LOCAL_STEPS else "local" if kinds else ""
            edges.append(GraphEdge(reshard.producer, item.node, how, str(reshard)))
    legend_items = [("replicated", _KIND_COLOURS["replicated"]), ("sharded over mesh axis 0", _AXES_COLOURS[0]),
                    ("over mesh axis 1", _AXES_COLOURS[1]), ("over both", _AXES_COLOURS[2]),
                    ("partial (reduction deferred)", _KIND_COLOURS["partial"]), ("wrong in the check", "#ffd8d3")]
    legend = '<div class="legend">' + "".join(
        f'<span><span class="swatch" style="background:{c}"></span>{text(w)}</span>' for w, c in legend_items) + \
        '<span><span class="swatch" style="background:#cf222e"></span>an edge that moves data between devices</span>' \
        '<span><span class="swatch" style="background:#0969da"></span>an edge where each device slices what it holds' \
        '</span></div>'
    return legend + graph_figure(nodes, edges, "Each box a node of the captured model in graph order, its output's "
                                 "layout on the second line; hover a box or an edge for its strategy or resharding.")


def plan_page(result: PlanResult, model: str, headline: Sequence[str], title: str = "shardverify plan") -> Page:
    """The page of ``result``, the check of ``model``'s plan; ``headline``: the verdict lines the
    terminal shows (plan.report.verdict_lines), the first one the verdict."""
    plan, coverage = result.plan, result.coverage
    mesh = list(plan.mesh_shape)
    sharded = [item for item in plan.nodes if item.strategy is not None and how_sharded(item)[0] != "replicated"]
    summary = [line for line in headline if not line.startswith("detail:")]
    culprit = "" if result.passed else result.summary()
    failing = {m.node for m in result.mismatches if m.node}
    sections = [Section("The plan over the model", _graph(plan, failing), "graph")]
    if result.mismatches:
        rows = [(m.phase, m.node, "every rank" if m.rank < 0 else m.rank, m.tensor,
                 "" if m.max_abs_err is None else f"{m.max_abs_err:.3g}") for m in result.mismatches]
        sections.append(Section(f"What the check found wrong ({len(rows)})",
                                table(("phase", "node", "rank", "tensor", "max abs error"), rows), "mismatches"))
    if coverage is not None:
        sections.append(Section("Coverage", "<pre>" + text("\n".join(coverage.lines())) + "</pre>", "coverage"))
    node_rows = [(item.node, item.strategy_name, how_sharded(item)[0],
                  "; ".join(f"{r.operand}: {', '.join(map(str, r.steps))}" for r in item.reshards if r.steps))
                 for item in plan.nodes]
    sections.append(Section("Every node", table(("node", "strategy", "output", "resharding before it"), node_rows,
                                                bad=[row[0] in failing for row in node_rows]), "nodes"))
    drawn = "".join(details(f"{item.node}: {item.strategy_name}", strategy_figures(item.strategy))
                    for item in sharded[:MOST_DRAWN])
    more = f'<p class="muted">{len(sharded) - MOST_DRAWN} more sharded nodes are listed above.</p>' \
        if len(sharded) > MOST_DRAWN else ""
    if sharded:
        sections.append(Section("Layouts of the sharded nodes", rank_legend(math.prod(mesh)) + drawn + more,
                                "layouts"))
    if result.notes:
        sections.append(Section("Notes", "".join(f"<p>{text(n)}</p>" for n in result.notes)))
    return Page(title, result.passed, tuple(summary), tuple(sections), culprit)
