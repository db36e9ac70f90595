"""The arguments each rank of a ``rules`` strategy passes in place of the call's own: its own
block's part of a shape argument (``shape_param``), its block's start and end of a range
factory (``range_params``), the sizes of its blocks of the factors a size parameter names
(``size_params``); and the handler serving the call, which says where the call passes them."""

from __future__ import annotations

import math

from shardverify.errors import StrategyError
from shardverify.sharding.blocks import nested_block
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.sharding.strategy import LocalArg, OperandLocator
from shardverify.strategies.generators.registry import GeneratorContext
from shardverify.strategies.rules.rule import Rule
from shardverify.strategies.rules.sources.base import Source

__all__ = ["serving_handler", "shape_locator", "shape_argument", "range_arguments", "size_arguments"]


def serving_handler(ctx: GeneratorContext):
    """The handler serving the call (one of several a target may have, each bound to its own
    parameter values): the context carries it, a registry lookup could pick another."""
    if ctx.handler is None:
        raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r}: the rules generator runs for a handler; "
                            f"call it through strategies_for_node")
    return ctx.handler


def shape_locator(ctx: GeneratorContext, source: Source) -> OperandLocator | None:
    """Where the call passes the output shape that each rank replaces by its local one
    (``shape_param``); None without one."""
    from shardverify.strategies.handlers.call_values import param_locator

    if not source.shape_param:
        return None
    locator = param_locator(serving_handler(ctx), ctx.node, source.shape_param)
    if locator is None:
        raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r} does not pass the shape parameter "
                            f"{source.shape_param!r} that the rule replaces by each rank's local shape")
    return locator


def shape_argument(ctx: GeneratorContext, at: OperandLocator, out: ShardingSpec, part: slice,
                    uneven: bool) -> LocalArg:
    """The shape argument each rank passes: its own block's part of the output shape."""
    value = out.local_shape()[part]
    if not uneven:
        return LocalArg(at, value)
    return LocalArg(at, value, tuple(out.local_shape_on(ctx.mesh, rank)[part] for rank in ctx.mesh.ranks))


def range_arguments(ctx: GeneratorContext, names: tuple[str, ...], out: ShardingSpec) -> tuple[LocalArg, ...]:
    """A range factory's start and end on each rank: ``start + lo * step`` and ``start + hi *
    step`` for the rank's block ``[lo, hi)`` of the output's one dim (ints stay ints, so the
    dtype torch infers is the call's); with a float, the end falls half a step before the block's
    end, so rounding adds no element. Nothing to replace for the replicated layout."""
    from shardverify.strategies.handlers.call_values import param_locator

    if not out.dim_partition:
        return ()
    values = []
    for name in names:
        value = ctx.params.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r}: the range parameter {name!r} is "
                                f"{value!r}, not a number the ranks can offset")
        values.append(value)
    start, _, step = values
    exact = all(isinstance(v, int) for v in values)
    per_rank = []
    for rank in ctx.mesh.ranks:
        block = out.local_slices(ctx.mesh, rank)[0]
        lo, hi = block.start or 0, block.stop
        first = start + lo * step
        last = first if hi == lo else start + hi * step if exact else start + (hi - 0.5) * step
        per_rank.append((first, last))
    found = []
    for k, name in enumerate(names[:2]):
        at = param_locator(serving_handler(ctx), ctx.node, name)
        if at is None:
            raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r} does not pass the range parameter "
                                f"{name!r} that each rank replaces by its own")
        found.append(LocalArg(at, per_rank[0][k], tuple(p[k] for p in per_rank)))
    return tuple(found)


def size_arguments(ctx: GeneratorContext, rule: Rule, source: Source,
                    axes: dict[str, tuple[int, ...]]) -> tuple[LocalArg, ...] | None:
    """For each ``size_params`` parameter whose factors this layout shards: each rank passes the
    product of its own blocks' sizes of the factors it names (``"..."``: every factor the
    ellipsis stands for; a conv's groups=2 on a rank holding 2 of 4 groups). None where such a
    parameter is left at its default by the call: no place to pass a rank's own size."""
    if not source.size_params:
        return ()
    from shardverify.strategies.handlers.call_values import param_locator

    sizes, mesh = rule.size, ctx.mesh
    found = []
    for param, named in source.size_params:
        factors = [f for f in named if f != "..."] + \
            ([f for f in sizes if f.startswith("_b")] if "..." in named else [])
        missing = [f for f in factors if f not in sizes]
        if missing:
            raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r}: size_params {param!r} names factor(s) "
                                f"{missing} the call's rule does not hold")
        if not any(axes.get(f) for f in factors):
            continue          # unsharded: every rank passes the call's own value
        at = param_locator(serving_handler(ctx), ctx.node, param)
        if at is None:
            return None

        def local(rank: int) -> int:
            coord = mesh.coordinate(rank)
            return math.prod(nested_block(sizes[f], [(mesh.shape[a], coord[a]) for a in axes.get(f, ())])[1]
                             for f in factors)

        values = tuple(local(rank) for rank in mesh.ranks)
        found.append(LocalArg(at, values[0], values if len(set(values)) > 1 else ()))
    return tuple(found)
