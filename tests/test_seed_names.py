"""The seed's contract for following ops (ColossalAI's sum handler test): sum after
F.linear offers one strategy per strategy of the linear, in its order, named
``<input layout> -> <output layout>_<linear strategy index>``, identical layouts included; the
plan collapses those alike but in name, and the verifier checks each layout once."""

import pytest
import torch
import torch.nn.functional as F

from shardverify import DeviceMesh, strategies_for_node, trace
from test_linear_strategies import REFERENCE_2D, colossal

# The seed's names for sum(F.linear(input (8, 16, 64, 32), other (64, 32)), dims, keepdim) on a
# (2, 2) mesh, in the seed's order: one per linear strategy of REFERENCE_2D (its index i).
SEED_SUM = {
    ((0, 2), False): [
        "[R, R, R, S1] -> [R, S1]_0", "[R, S0, R, S1] -> [S0, S1]_1", "[R, R, R, S1] -> [R, S1]_2",
        "[R, R, R, S0] -> [R, S0]_3", "[R, S1, R, S0] -> [S1, S0]_4", "[R, R, R, S0] -> [R, S0]_5",
        "[R, R, R, R] -> [R, R]_6", "[R, S0, R, R] -> [S0, R]_7", "[R, R, R, R] -> [R, R]_8",
        "[R, R, R, R] -> [R, R]_9", "[R, S1, R, R] -> [S1, R]_10", "[R, R, R, R] -> [R, R]_11",
        "[R, R, R, S1] -> [R, S1]_12", "[R, R, R, S0] -> [R, S0]_13", "[R, R, R, R] -> [R, R]_14",
        "[R, R, R, R] -> [R, R]_15", "[R, R, R, S0] -> [R, S0]_16", "[R, R, R, S1] -> [R, S1]_17",
        "[R, R, R, R] -> [R, R]_18", "[R, S01, R, R] -> [S01, R]_19", "[R, R, R, R] -> [R, R]_20",
        "[R, R, R, R] -> [R, R]_21", "[R, R, R, S01] -> [R, S01]_22", "[R, R, R, R] -> [R, R]_23",
    ],
    ((0, 2), True): [
        "[R, R, R, S1] -> [R, R, R, S1]_0", "[R, S0, R, S1] -> [R, S0, R, S1]_1", "[R, R, R, S1] -> [R, R, R, S1]_2",
        "[R, R, R, S0] -> [R, R, R, S0]_3", "[R, S1, R, S0] -> [R, S1, R, S0]_4", "[R, R, R, S0] -> [R, R, R, S0]_5",
        "[R, R, R, R] -> [R, R, R, R]_6", "[R, S0, R, R] -> [R, S0, R, R]_7", "[R, R, R, R] -> [R, R, R, R]_8",
        "[R, R, R, R] -> [R, R, R, R]_9", "[R, S1, R, R] -> [R, S1, R, R]_10", "[R, R, R, R] -> [R, R, R, R]_11",
        "[R, R, R, S1] -> [R, R, R, S1]_12", "[R, R, R, S0] -> [R, R, R, S0]_13", "[R, R, R, R] -> [R, R, R, R]_14",
        "[R, R, R, R] -> [R, R, R, R]_15", "[R, R, R, S0] -> [R, R, R, S0]_16", "[R, R, R, S1] -> [R, R, R, S1]_17",
        "[R, R, R, R] -> [R, R, R, R]_18", "[R, S01, R, R] -> [R, S01, R, R]_19", "[R, R, R, R] -> [R, R, R, R]_20",
        "[R, R, R, R] -> [R, R, R, R]_21", "[R, R, R, S01] -> [R, R, R, S01]_22", "[R, R, R, R] -> [R, R, R, R]_23",
    ],
    ((1,), False): [
        "[S0, R, R, S1] -> [S0, R, S1]_0", "[R, R, R, S1] -> [R, R, S1]_1", "[R, R, S0, S1] -> [R, S0, S1]_2",
        "[S1, R, R, S0] -> [S1, R, S0]_3", "[R, R, R, S0] -> [R, R, S0]_4", "[R, R, S1, S0] -> [R, S1, S0]_5",
        "[S0, R, R, R] -> [S0, R, R]_6", "[R, R, R, R] -> [R, R, R]_7", "[R, R, S0, R] -> [R, S0, R]_8",
        "[S1, R, R, R] -> [S1, R, R]_9", "[R, R, R, R] -> [R, R, R]_10", "[R, R, S1, R] -> [R, S1, R]_11",
        "[R, R, R, S1] -> [R, R, S1]_12", "[R, R, R, S0] -> [R, R, S0]_13", "[R, R, R, R] -> [R, R, R]_14",
        "[R, R, R, R] -> [R, R, R]_15", "[R, R, R, S0] -> [R, R, S0]_16", "[R, R, R, S1] -> [R, R, S1]_17",
        "[S01, R, R, R] -> [S01, R, R]_18", "[R, R, R, R] -> [R, R, R]_19", "[R, R, S01, R] -> [R, S01, R]_20",
        "[R, R, R, R] -> [R, R, R]_21", "[R, R, R, S01] -> [R, R, S01]_22", "[R, R, R, R] -> [R, R, R]_23",
    ],
    ((1,), True): [
        "[S0, R, R, S1] -> [S0, R, R, S1]_0", "[R, R, R, S1] -> [R, R, R, S1]_1",
        "[R, R, S0, S1] -> [R, R, S0, S1]_2", "[S1, R, R, S0] -> [S1, R, R, S0]_3",
        "[R, R, R, S0] -> [R, R, R, S0]_4", "[R, R, S1, S0] -> [R, R, S1, S0]_5", "[S0, R, R, R] -> [S0, R, R, R]_6",
        "[R, R, R, R] -> [R, R, R, R]_7", "[R, R, S0, R] -> [R, R, S0, R]_8", "[S1, R, R, R] -> [S1, R, R, R]_9",
        "[R, R, R, R] -> [R, R, R, R]_10", "[R, R, S1, R] -> [R, R, S1, R]_11", "[R, R, R, S1] -> [R, R, R, S1]_12",
        "[R, R, R, S0] -> [R, R, R, S0]_13", "[R, R, R, R] -> [R, R, R, R]_14", "[R, R, R, R] -> [R, R, R, R]_15",
        "[R, R, R, S0] -> [R, R, R, S0]_16", "[R, R, R, S1] -> [R, R, R, S1]_17",
        "[S01, R, R, R] -> [S01, R, R, R]_18", "[R, R, R, R] -> [R, R, R, R]_19",
        "[R, R, S01, R] -> [R, R, S01, R]_20", "[R, R, R, R] -> [R, R, R, R]_21",
        "[R, R, R, S01] -> [R, R, R, S01]_22", "[R, R, R, R] -> [R, R, R, R]_23",
    ],
}


class LinearSum(torch.nn.Module):
    def __init__(self, dims, keepdim):
        super().__init__()
        self.dims, self.keepdim = dims, keepdim

    def forward(self, input, other):
        return torch.sum(F.linear(input, other, bias=None), self.dims, keepdim=self.keepdim)


def seed_graph(dims, keepdim):
    return trace(LinearSum(dims, keepdim), meta_args={"input": torch.empty(8, 16, 64, 32, device="meta"),
                                                     "other": torch.empty(64, 32, device="meta")})


@pytest.mark.parametrize("dims,keepdim", list(SEED_SUM))
def test_sum_offers_every_seed_name_in_the_seed_order_one_per_linear_strategy(dims, keepdim):
    gm, mesh = seed_graph(dims, keepdim), DeviceMesh((2, 2))
    linear, vector = strategies_for_node(gm, "linear", mesh), strategies_for_node(gm, "sum_1", mesh)
    assert colossal(linear.names) == REFERENCE_2D
    assert vector.names[:24] == SEED_SUM[dims, keepdim]          # duplicates of layout included
    # every linear strategy (69, the seed's 24 among them) has its own, in order, by its index
    assert len(vector) > len(linear) == 69
    for index, (pred, strategy) in enumerate(zip(linear, vector)):
        assert strategy.name.endswith(f"_{index}") and " | P" not in strategy.name
        produced = pred.get_sharding_spec_by_name("linear").partition_dict()
        kept = {d: axes for d, axes in produced.items() if d not in dims}
        assert strategy.get_sharding_spec_by_name("linear").partition_dict() == kept
        assert strategy.communication_actions == ()
    replicated = "[R, R, R, R] -> [R, R, R, R]_68" if keepdim else f"[R, R, R, R] -> [{', '.join(['R'] * (4 - len(dims)))}]_68"
    assert vector.names[68] == replicated                         # the seed's RR = RR x RR, last of the linear's


def test_the_plan_collapses_strategies_alike_but_in_name():
    from shardverify.plan.coverage import classify_nodes

    gm, mesh = seed_graph((0, 2), False), DeviceMesh((2, 2))
    vector = strategies_for_node(gm, "sum_1", mesh)
    options, _ = classify_nodes(gm, mesh)
    keys = [s.layout_key() for s in vector]
    assert len(options["sum_1"]) == len(set(keys)) < len(vector)
    assert [s.name for s in options["sum_1"]] == [vector[keys.index(k)].name for k in dict.fromkeys(keys)]


def test_the_verifier_checks_each_layout_once_and_says_so(monkeypatch):
    from shardverify.backends import SimulatedBackend
    from shardverify.spec.case import InputDecl, ModuleDecl, OpCase
    from shardverify.verify import engine

    case = OpCase(op="sum", target="torch.sum", inputs=(InputDecl("input", (2, 4, 6), "float32"),),
                  params=(("dim", 1), ("keepdim", False)), module=None,
                  predecessor=ModuleDecl("torch.nn.Linear", args=(6, 4), kwargs=(("bias", False),)))
    checked = []
    run = engine._run_checks
    monkeypatch.setattr(engine, "_run_checks", lambda b, c, strategies, *rest: checked.extend(strategies)
                        or run(b, c, strategies, *rest))
    with SimulatedBackend(DeviceMesh((2,))) as backend:
        gm, node = case.build()
        vector = strategies_for_node(gm, node, backend.mesh)
        results = engine.verify_case(backend, case)
    keys = [s.layout_key() for s in vector]
    assert len(set(keys)) < len(vector)
    assert [r.strategy for r in results] == vector.names and all(r.passed for r in results)
    assert [s.layout_key() for s in checked] == list(dict.fromkeys(keys))     # once each
    for strategy, result in zip(vector, results):
        first = vector[keys.index(strategy.layout_key())]
        assert ("checked once" in result.note) == (first is not strategy)
        assert first is strategy or f"the layouts of {first.name!r}" in result.note


def test_naming_is_validated():
    from shardverify.errors import InvalidArgument
    from shardverify.strategies.rules.sources import parse_rule

    with pytest.raises(InvalidArgument, match="'naming' must be one of .*got 'colossal'"):
        parse_rule({"follow": "input", "reduce_dims_param": "dim", "naming": "colossal"})


@pytest.mark.parametrize("mesh_shape", [(2, 2), (4,)])
def test_the_rules_engine_offers_exactly_the_layouts_sum_follows(mesh_shape):
    """The ``follow`` option is an order and a naming, no new strategy: after a complete Linear,
    the rules family with sum's reduction options and no ``follow`` offers exactly the distinct
    layouts sum's handler (``follow: input``, ColossalAI's naming) does."""
    import dataclasses

    from shardverify.strategies.handlers import base
    from shardverify.strategies.rules.sources import parse_rule

    def layouts(vector):
        return {(tuple((n, str(spec.sharding_sequence)) for n, spec in s.sharding_specs),
                 tuple((a.pattern.name, a.axes, a.op) for a in s.communication_actions),
                 tuple((p.operand, p.axes) for p in s.partial_inputs)) for s in vector}

    mesh = DeviceMesh(mesh_shape)
    following = strategies_for_node(seed_graph((0, 2), False), "sum_1", mesh)
    handler, = base._REGISTRY[torch.sum]
    rules = dataclasses.replace(handler, generator="rules", rule=parse_rule(
        {"reduce_dims_param": "dim", "keepdim_param": "keepdim", "reduce_op": "sum", "linear_in": ("input",)}))
    base._REGISTRY[torch.sum] = (rules,)
    try:
        by_rules = strategies_for_node(seed_graph((0, 2), False), "sum_1", mesh)
    finally:
        base._REGISTRY[torch.sum] = (handler,)
    assert layouts(following) == layouts(by_rules)
    assert len(by_rules) == len(layouts(by_rules)) < len(following)
