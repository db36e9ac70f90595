"""shardverify: declarative, numerically verified tensor-sharding strategies."""

from shardverify.errors import *  # noqa: F401,F403
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.sharding_spec import DimSpec, ShardingSequence, ShardingSpec
from shardverify.sharding.strategy import (
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
from shardverify.capture.fx import trace
from shardverify.strategies.for_node import strategies_for_node
from shardverify.plan import verify_plan
from shardverify.verify.on_demand import OnDemandVerifier, verify_node
