"""shardverify: declarative, numerically verified tensor-sharding strategies."""

from shardverify.errors import *  # noqa: F401,F403
from shardverify.mesh import DeviceMesh
from shardverify.sharding import DimSpec, ShardingSequence, ShardingSpec
from shardverify.strategy import (
    CommAction,
    CommPattern,
    CommWhere,
    MemoryCost,
    MemoryCycle,
    OperandLocator,
    OperationData,
    OperationDataType,
    ShardingStrategy,
    StrategiesVector,
    TrainCycleItem,
)
from shardverify.tracing import trace
from shardverify.api import strategies_for_node
from shardverify.plan import verify_plan
