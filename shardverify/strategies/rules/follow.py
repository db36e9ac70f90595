"""The rules engine's ``follow: <role>`` option: a reduction (or elementwise op) that takes up
each layout its operand ``role`` arrives in, in its producer's order, named by its index.

For each layout the operand can arrive in (each strategy of its producer, in order; for a graph
input or attribute, whose node is replicated but which a plan may lay out any way by a local
slice, every layout its shape admits, replicated first): the strategy that gathers a shard on
a reduced factor (``[S0, R] -> [R]_<index>``, no communication), then, where the producer
shards a reduced factor, the one keeping it, its partial output reduced after the op
(``[S0, R] -> [R] | P0 sum_<index>``, unless the blocks forbid it:
:func:`~shardverify.sharding.blocks.partial_refusal`); with ``linear_in: [<role>]`` each again
with the operand a partial sum over each set of free mesh axes (``[R, R]+P1 -> [R] | P1 sum_0``,
after all the others). The engine derives every strategy from the rule as always.

``naming: rules`` (default) offers each layout once, named by the first index giving it;
``naming: colossalai`` keeps ColossalAI's contract (the seed's sum test): first one gathered
strategy per producer strategy, in its order, identical layouts included (the plan collapses
them, the verifier checks each layout once), then the others, each layout once.
"""

from __future__ import annotations

import itertools
import math

from shardverify.capture.call import tuple_element
from shardverify.errors import StrategyError
from shardverify.sharding.blocks import partial_refusal
from shardverify.sharding.strategy import OperationData, ShardingStrategy
from shardverify.strategies.rules.rule import Rule

__all__ = ["offered", "every_layout"]

Layout = dict[int, tuple[int, ...]]


def offered(build, ctx, rule: Rule, options, inputs: list[OperationData],
            outputs: list[OperationData]) -> list[ShardingStrategy]:
    """The strategies in the producer's order; ``build(axes, partial, name)`` is the engine's
    derivation, the strategy named by ``name(specs, partial, actions)`` (:func:`_namer`).
    Many producer strategies give one layout (a following op is offered one strategy per
    predecessor strategy): each distinct layout's strategies are derived once, at its first
    arrival, and a strategy is named per index only where it is offered (a layout arriving
    again brings its gathered strategy under ``naming: colossalai``, and nothing new else)."""
    roles = [d.role for d in inputs]
    if options.follow not in roles or len(inputs) != 1 or len(outputs) != 1:
        raise StrategyError(f"option follow: {options.follow!r} must name the one tensor operand of a one-output "
                            f"call; this call has {roles}")
    data, term, out = inputs[0], rule.inputs[0], outputs[0]
    build = _derived_once(build, _namer(data.name, out.name))
    reduce_ops = dict(rule.reduce)
    linear = options.linear_in == ((data.role,),) and data.dtype.is_floating_point and out.dtype.is_floating_point
    mesh_shape = ctx.mesh.shape
    colossalai = options.naming == "colossalai"
    sizes, refusal = rule.size, _refusals()
    # (derived strategy, predecessor index, whether it is the gathered one), in offering order
    strategies: list[tuple[ShardingStrategy, int, bool]] = []
    pieces: list[tuple[ShardingStrategy, int, bool]] = []
    gathered_of: dict[tuple, ShardingStrategy] = {}    # layout -> its gathered strategy, derived once
    for index, items in enumerate(_arrivals(ctx, data)):
        key = tuple(sorted(items))
        if key in gathered_of:     # its partial and piece strategies are the first arrival's: named there
            if colossalai:
                strategies.append((gathered_of[key], index, True))
            continue
        produced = dict(items)
        if any(not term[d] for d in produced):
            raise StrategyError(f"node {ctx.node.name!r}: its producer lays mesh axes on a size-1 dim of {data.name!r}")
        axes = {term[d][0]: held for d, held in produced.items()}
        kept = {f: held for f, held in axes.items() if f not in reduce_ops}
        gathered = build(kept, {})
        if gathered is None:
            raise StrategyError(f"operand {data.name!r}: a layout its producer gives does not fit the call")
        gathered_of[key] = gathered
        strategies.append((gathered, index, True))
        if linear:
            pieces += _pieces(build, kept, data, index, mesh_shape)
        partial = tuple(sorted(a for f, held in axes.items() if f in reduce_ops for a in held))
        refused = any(refusal(reduce_ops[f], sizes[f], tuple(mesh_shape[a] for a in held))
                      for f, held in axes.items() if f in reduce_ops)
        if math.prod(mesh_shape[a] for a in partial) > 1 and out.dtype.is_floating_point and not refused:
            strategy = build(axes, {})
            if strategy is not None:
                strategies.append((strategy, index, False))
                if linear and set(reduce_ops[f] for f in axes if f in reduce_ops) == {"sum"}:
                    pieces += _pieces(build, axes, data, index, mesh_shape)
    if colossalai:   # every gathered one, then the others not among them, each once
        return [_named(strategy, index) for strategy, index, first in strategies if first] + \
            _first_of_each([entry for entry in strategies + pieces if not entry[2]])
    return _first_of_each(strategies + pieces)


def _refusals():
    """:func:`partial_refusal`, remembering its answers: the layouts a producer gives cut the
    reduced factors the same few ways."""
    found: dict[tuple, str | None] = {}

    def refusal(op: str, size: int, parts: tuple[int, ...]) -> str | None:
        key = (op, size, parts)
        if key not in found:
            found[key] = partial_refusal(op, size, parts)
        return found[key]

    return refusal


def _derived_once(build, name):
    """``build`` remembering each (axes, partial) it derived (None included: a layout that does
    not fit the call does not fit it the second time either), each strategy named by ``name``."""
    found: dict[tuple, ShardingStrategy | None] = {}

    def once(axes: dict, partial: dict) -> ShardingStrategy | None:
        key = (tuple(sorted(axes.items())), tuple(sorted(partial.items())))
        if key not in found:
            found[key] = build(axes, partial, name)
        return found[key]

    return once


def _namer(data: str, out: str):
    """``name(specs, partial, actions)``: ``[S0, R]+P1 -> [R] | P01 sum``, the layouts of operand
    ``data`` and output ``out``, the partial input, the output's reduce, which a predecessor's
    index follows (:func:`_named`). A derived strategy carries it as its name: it is named per
    predecessor strategy giving its layout from there, without working it out again."""
    def name(specs: dict, partial: dict, actions) -> str:
        piece = partial.get(data)
        text = str(specs[data])    # its sharding sequence, remembered
        text += f"+P{''.join(map(str, piece))}" if piece else ""
        text += f" -> {specs[out]}"
        return text + "".join(f" | P{''.join(map(str, a.axes))} {a.op}" for a in actions
                              if a.operand == out and a.axes)

    return name


def _named(strategy: ShardingStrategy, index: int) -> ShardingStrategy:
    """The derived strategy named for predecessor strategy ``index``: ``<its layout name>_<index>``."""
    return strategy.renamed(f"{strategy.name}_{index}")


def _pieces(build, axes: dict, data: OperationData, index: int,
            mesh_shape: tuple[int, ...]) -> list[tuple[ShardingStrategy, int, bool]]:
    """The strategy of ``axes`` again with the operand a partial sum over each set of free axes."""
    used = {a for held in axes.values() for a in held}
    free = [a for a, size in enumerate(mesh_shape) if size > 1 and a not in used]
    found = []
    for k in range(1, len(free) + 1):
        for held in itertools.combinations(free, k):
            strategy = build(axes, {data.name: held})
            if strategy is not None:
                found.append((strategy, index, False))
    return found


def produced_layouts(ctx, data: OperationData) -> list[Layout]:
    """The layouts (tensor dim -> mesh axes) the operand can arrive in: those its producer's
    strategies give it, or, for a graph input or attribute, every layout its shape admits."""
    return [dict(items) for items in _arrivals(ctx, data)]


def _arrivals(ctx, data: OperationData) -> list[tuple[tuple[int, tuple[int, ...]], ...]]:
    """:func:`produced_layouts`, each as its ``(dim, axes)`` items: a producer's layouts are read
    as its specs hold them (``dim_partition``), not copied into a dict per producer strategy."""
    producer = next((n for n in ctx.node.all_input_nodes if n.name == data.name), None)
    if producer is not None and producer.op in ("placeholder", "get_attr"):
        return [tuple(layout.items()) for layout in every_layout(data.shape, ctx.mesh.shape)]
    element = tuple_element(producer) if producer is not None else None
    of = ctx.layouts_of or ctx.strategies_of     # the producer's layouts: its costs are not read here
    if element is not None and of is not None:   # topk's values: as topk's strategies lay them out
        source, index = element
        return [pred.get_sharding_spec_by_name(pred.outputs[index].name).dim_partition for pred in of(source)]
    return [pred.get_sharding_spec_by_name(data.name).dim_partition for pred in ctx.predecessor_layouts(data.role)]


def every_layout(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[Layout]:
    """Each mesh axis (of more than one rank) given to one dim of two or more elements or to
    none, a dim's axes in every order (``S01`` and ``S10``); the replicated layout first."""
    axes = [a for a, size in enumerate(mesh_shape) if size > 1]
    dims = [d for d, size in enumerate(shape) if size > 1]
    found: list[Layout] = []
    for choice in itertools.product([None, *dims], repeat=len(axes)):
        ascending: Layout = {}
        for axis, dim in zip(axes, choice):
            if dim is not None:
                ascending[dim] = ascending.get(dim, ()) + (axis,)
        for orders in itertools.product(*(itertools.permutations(held) for held in ascending.values())):
            found.append(dict(zip(ascending, orders)))
    return found


def _first_of_each(entries: list[tuple[ShardingStrategy, int, bool]]) -> list[ShardingStrategy]:
    """The first strategy of each layout, named by its index: its layout name (:func:`_namer`)
    says every layout and action (several producer strategies produce the same layout)."""
    found: dict[str, ShardingStrategy] = {}
    for strategy, index, _ in entries:
        if strategy.name not in found:
            found[strategy.name] = _named(strategy, index)
    return list(found.values())
