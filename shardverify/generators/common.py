"""Cost model and strategy assembly shared by every generator.

Costs are per device: compute in multiply counts, memory in bytes of local shards,
communication in seconds from the mesh's alpha-beta model for the declared actions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shardverify.errors import StrategyError
from shardverify.generators.registry import GeneratorContext
from shardverify.sharding import ShardingSpec
from shardverify.strategy import (
    CommAction,
    CommPattern,
    MemoryCost,
    MemoryCycle,
    OperationData,
    OperationDataType,
    ShardingStrategy,
    TrainCycleItem,
)

__all__ = ["local_bytes", "memory_cost", "communication_cost", "make_strategy"]


def local_bytes(data: OperationData, spec: ShardingSpec) -> int:
    return spec.local_numel() * data.itemsize


def memory_cost(operands: Sequence[OperationData], specs: Mapping[str, ShardingSpec]) -> MemoryCycle:
    """Forward keeps every operand's shard; backward adds a gradient for every input and parameter."""
    fwd, bwd = MemoryCost(), MemoryCost()
    for data in operands:
        size = local_bytes(data, specs[data.name])
        if data.is_param:
            fwd += MemoryCost(parameter=size)
            bwd += MemoryCost(parameter=size)
        else:
            fwd += MemoryCost(activation=size)
            if data.type is not OperationDataType.OUTPUT:
                bwd += MemoryCost(activation=size)
    return MemoryCycle(fwd, bwd, fwd + bwd)


def communication_cost(mesh, actions: Sequence[CommAction], operands: Mapping[str, OperationData],
                       specs: Mapping[str, ShardingSpec]) -> TrainCycleItem:
    """Seconds spent in the declared actions (bytes are the operand's local shard)."""
    fwd = bwd = 0.0
    for action in actions:
        size = local_bytes(operands[action.operand], specs[action.operand])
        n = mesh.axes_size(action.axes)
        if action.pattern is CommPattern.ALLREDUCE_FWD_IDENTITY_BWD:
            fwd += mesh.all_reduce_cost(size, action.axes)
        elif action.pattern is CommPattern.IDENTITY_FWD_ALLREDUCE_BWD:
            bwd += mesh.all_reduce_cost(size, action.axes)
        elif action.pattern is CommPattern.GATHER_FWD_SPLIT_BWD:
            fwd += mesh.all_gather_cost(size * n, action.axes)
        elif action.pattern is CommPattern.SPLIT_FWD_GATHER_BWD:
            bwd += mesh.all_gather_cost(size, action.axes)
        else:
            fwd += mesh.all_to_all_cost(size, action.axes)
            bwd += mesh.all_to_all_cost(size, action.axes)
    return TrainCycleItem(fwd, bwd, fwd + bwd)


def make_strategy(ctx: GeneratorContext, name: str, operands: Sequence[OperationData],
                  specs: Mapping[str, ShardingSpec], actions: Sequence[CommAction],
                  compute: tuple[float, float]) -> ShardingStrategy:
    """Assemble a strategy over ``operands`` (output last) with all three costs filled in."""
    missing = [d.name for d in operands if d.name not in specs]
    if missing:
        raise StrategyError(f"{ctx.handler_name}: strategy {name!r} has no layout for {missing}")
    by_name = {d.name: d for d in operands}
    fwd, bwd = compute
    return ShardingStrategy(
        name=name,
        sharding_specs=tuple((d.name, specs[d.name]) for d in operands),
        operands=tuple(operands),
        compute_cost=TrainCycleItem(float(fwd), float(bwd), float(fwd + bwd)),
        memory_cost=memory_cost(operands, specs),
        communication_cost=communication_cost(ctx.mesh, actions, by_name, specs),
        communication_actions=tuple(actions),
    )
