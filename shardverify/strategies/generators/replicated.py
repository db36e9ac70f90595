"""The one fully replicated strategy of a graph input or constant (a placeholder, a get_attr):
no handler serves those nodes, and the ops consuming them need a predecessor to follow. Not a
generator family: a spec wanting every tensor whole says so in its rule (``whole_tensors``)."""

from __future__ import annotations

from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.sharding.strategy import ShardingStrategy
from shardverify.strategies.generators.common import make_strategy
from shardverify.strategies.generators.registry import GeneratorContext

__all__ = ["source_strategy"]


def source_strategy(ctx: GeneratorContext, name: str) -> list[ShardingStrategy]:
    """The strategy ``name`` holding every operand of ``ctx`` whole on every device."""
    operands = list(ctx.operands.values())
    specs = {d.name: ShardingSpec.replicated(ctx.mesh.shape, d.shape) for d in operands}
    return [make_strategy(ctx, name, operands, specs, (), (0, 0))]
