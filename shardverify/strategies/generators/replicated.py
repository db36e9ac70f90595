"""One fully replicated strategy: for graph inputs and constants that have no handler, so
that the ops consuming them have a predecessor to follow."""

from __future__ import annotations

from shardverify.strategies.generators.common import make_strategy
from shardverify.strategies.generators.registry import GeneratorContext, register_generator
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.sharding.strategy import ShardingStrategy


@register_generator("replicated")
def generate(ctx: GeneratorContext) -> list[ShardingStrategy]:
    operands = list(ctx.operands.values())
    specs = {d.name: ShardingSpec.replicated(ctx.mesh.shape, d.shape) for d in operands}
    return [make_strategy(ctx, str(ctx.option("name", "Replica")), operands, specs, (), (0, 0))]
