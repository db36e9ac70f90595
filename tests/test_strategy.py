import pytest
import torch

from shardverify import (
    CommAction,
    CommPattern,
    CommWhere,
    MemoryCost,
    MemoryCycle,
    OperandLocator,
    OperationData,
    OperationDataType,
    ShardingSpec,
    ShardingStrategy,
    StrategiesVector,
    StrategyError,
    TrainCycleItem,
)


def _operands():
    x = OperationData("input_1", OperationDataType.ARG, "input", (4, 4, 16), torch.float32,
                      logical_shape=(16, 16), locator=OperandLocator("arg", 0))
    out = OperationData("out", OperationDataType.OUTPUT, "output", (4, 4, 16), torch.float32,
                        locator=OperandLocator("output"))
    return x, out


def _strategy(**changes):
    x, out = _operands()
    spec = ShardingSpec.parse("[S0, R, R]", (4, 4, 16), (2, 2))
    fields = dict(
        name="S0 -> S0", sharding_specs=(("input_1", spec), ("out", spec)), operands=(x, out),
        compute_cost=TrainCycleItem(1, 2, 3),
        memory_cost=(MemoryCost(10, 0), MemoryCost(5, 0), MemoryCost(15, 0)),
        communication_cost=TrainCycleItem(0, 0, 0),
        communication_actions=(CommAction(CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, (1,), "input_1",
                                          CommWhere.BEFORE),),
    )
    fields.update(changes)
    return ShardingStrategy(**fields)


def test_operation_data_logical_shape_defaults_to_shape():
    x, out = _operands()
    assert x.logical_shape == (16, 16) and out.logical_shape == (4, 4, 16)
    assert x.itemsize == 4 and not x.is_param
    with pytest.raises(StrategyError, match=r"logical shape \(3, 16\)"):
        OperationData("a", OperationDataType.ARG, "input", (4, 16), torch.float32, logical_shape=(3, 16),
                      locator=OperandLocator("arg", 0))


@pytest.mark.parametrize("kind,key", [("arg", "x"), ("kwarg", 1), ("param", None), ("output", "x"), ("output", True), ("item", 0), ("item", (0, -1)), ("slot", 0)])
def test_bad_locators_are_rejected(kind, key):
    with pytest.raises(StrategyError, match=repr(kind) if kind == "slot" else "key"):
        OperandLocator(kind, key)


def test_strategy_lookups_and_replace():
    strategy = _strategy()
    assert isinstance(strategy.memory_cost, MemoryCycle)
    assert strategy.memory_cost.total == MemoryCost(15, 0)
    assert str(strategy.get_sharding_spec_by_name("out").sharding_sequence) == "[S0, R, R]"
    assert strategy.get_op_data_by_name("input_1").role == "input"
    assert strategy.output.name == "out"
    broken = strategy.replace(communication_actions=())
    assert broken.communication_actions == () and strategy.communication_actions
    with pytest.raises(StrategyError, match="'weight'.*input_1"):
        strategy.get_sharding_spec_by_name("weight")
    with pytest.raises(StrategyError, match="'weight'"):
        strategy.get_op_data_by_name("weight")


def test_inconsistent_strategies_are_rejected():
    spec = ShardingSpec.parse("[S0, R, R]", (4, 4, 16), (2, 2))
    with pytest.raises(StrategyError, match="do not match operands"):
        _strategy(sharding_specs=(("input_1", spec),))
    wrong = ShardingSpec.parse("[S0, R]", (4, 64), (2, 2))
    with pytest.raises(StrategyError, match=r"shape \(4, 64\)"):
        _strategy(sharding_specs=(("input_1", wrong), ("out", spec)))
    with pytest.raises(StrategyError, match="unknown operand 'bias'"):
        _strategy(communication_actions=(CommAction(CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, (0,), "bias",
                                                    CommWhere.AFTER),))


@pytest.mark.parametrize("pattern,axes,where,dims,needle", [
    (CommPattern.GATHER_FWD_SPLIT_BWD, (0,), CommWhere.BEFORE, (), "1 tensor dim"),
    (CommPattern.ALL2ALL_FWD_ALL2ALL_BWD, (0,), CommWhere.BEFORE, (1,), "2 tensor dim"),
    (CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, (), CommWhere.AFTER, (), "distinct mesh axes"),
    (CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, (1, 1), CommWhere.AFTER, (), "distinct mesh axes"),
    (CommPattern.SPLIT_FWD_GATHER_BWD, (0,), CommWhere.HOOK, (0,), "HOOK"),
])
def test_bad_comm_actions_are_rejected(pattern, axes, where, dims, needle):
    with pytest.raises(StrategyError, match=needle):
        CommAction(pattern, axes, "x", where, dims)


def test_strategies_vector_keeps_node_and_order():
    a, b = _strategy(), _strategy(name="other")
    vector = StrategiesVector("node", [a, b], predecessor_nodes=["p"])
    assert vector.names == ["S0 -> S0", "other"] and vector.node == "node"
    assert vector.predecessor_nodes == ["p"] and vector.by_name("other") is b
    with pytest.raises(StrategyError, match="'missing'"):
        vector.by_name("missing")
