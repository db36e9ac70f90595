"""A strategy's layouts drawn: every operand's blocks by rank, partial values marked."""

from __future__ import annotations

from shardverify.features.report.draw import EVERY_RANK, layout_figure, rank_colour
from shardverify.features.report.page import text
from shardverify.sharding.strategy import CommPattern, CommWhere, ShardingStrategy

__all__ = ["strategy_figures", "rank_legend"]


def _axes(axes: tuple[int, ...]) -> str:
    return ("mesh axis " if len(axes) == 1 else "mesh axes ") + ", ".join(map(str, axes))


def partial_words(strategy: ShardingStrategy, name: str) -> str:
    """How operand ``name`` is held as partial values, in words ("" when it is whole)."""
    piece = strategy.partial_input(name)
    if piece is not None:
        return f"each rank holds a piece; the pieces' {piece.op} over {_axes(piece.axes)} is the value"
    reduced = [a for a in strategy.communication_actions
               if a.operand == name and a.where is CommWhere.AFTER and a.pattern is CommPattern.ALLREDUCE_FWD_IDENTITY_BWD]
    if reduced:
        return "; ".join(f"the op gives each rank a partial {a.op} over {_axes(a.axes)}, all-reduced into this layout"
                         for a in reduced)
    return ""


def strategy_figures(strategy: ShardingStrategy) -> str:
    """Every operand of ``strategy`` drawn, inputs then outputs."""
    figures = [layout_figure(name, spec, partial=partial_words(strategy, name))
               for name, spec in strategy.sharding_specs]
    return f'<div class="figures">{"".join(figures)}</div>'


def rank_legend(ranks: int) -> str:
    """The ranks' colours."""
    items = [f'<span><span class="swatch" style="background:{rank_colour(r)}"></span>rank {r}</span>'
             for r in range(min(ranks, 16))]
    items.append(f'<span><span class="swatch" style="background:{EVERY_RANK}"></span>every rank</span>')
    return f'<div class="legend">{"".join(items)}</div>' + (
        f'<div class="muted">{text(ranks - 16)} more ranks, each a hue of its own</div>' if ranks > 16 else "")
