"""Strategies of the linear handler (the rules engine with naming: colossalai)."""

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

from shardverify import (
    CommPattern,
    CommWhere,
    DeviceMesh,
    HandlerError,
    InvalidArgument,
    OperationDataType,
    strategies_for_node,
    trace,
)
from shardverify.strategies.rules.colossal import every_family, logical_families, logical_name

# ColossalAI's names for nn.Linear(16, 32) on a (4, 4, 4, 16) input on a (2, 2) mesh, in its order.
REFERENCE_2D = [
    "S0S1 = S0R x RS1_0", "S0S1 = S0R x RS1_1", "S0S1 = S0R x RS1_2",
    "S1S0 = S1R x RS0_0", "S1S0 = S1R x RS0_1", "S1S0 = S1R x RS0_2",
    "S0R = S0S1 x S1R_0", "S0R = S0S1 x S1R_1", "S0R = S0S1 x S1R_2",
    "S1R = S1S0 x S0R_0", "S1R = S1S0 x S0R_1", "S1R = S1S0 x S0R_2",
    "RS1 = RS0 x S0S1", "RS0 = RS1 x S1S0",
    "RR = RS0 x S0R", "RR = RS1 x S1R",
    "RS0 = RR x RS0", "RS1 = RR x RS1",
    "S01R = S01R x RR_0", "S01R = S01R x RR_1", "S01R = S01R x RR_2",
    "RR = RS01 x S01R",
    "RS01 = RR x RS01",
    "RR = RR x RR",
]
CONTRACTION_SHARDED = ("SR = SS x SR", "RS = RS x SS", "RR = RS x SR", "RR = RS01 x S01R")


class ModuleModel(torch.nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.linear = torch.nn.Linear(16, 32, bias=bias)

    def forward(self, input):
        return self.linear(input)


class FunctionModel(torch.nn.Module):
    def forward(self, input, others, bias=None):
        return F.linear(input, others, bias=bias)


def module_strategies(mesh_shape, input_shape=(4, 4, 4, 16), bias=False):
    model = ModuleModel(bias)
    gm = trace(model, meta_args={"input": torch.empty(input_shape, device="meta")})
    return gm, strategies_for_node(gm, "linear", DeviceMesh(mesh_shape))


def test_module_op_data_mapping():
    _, vector = module_strategies((2, 2), bias=True)
    ops = {op.role: op for op in vector[0].operands}
    assert [op.role for op in vector[0].operands] == ["input", "other", "bias", "output"]
    assert (ops["input"].name, ops["input"].type, ops["input"].shape, ops["input"].logical_shape) == (
        "input_1", OperationDataType.ARG, (4, 4, 4, 16), (64, 16))
    assert (ops["other"].name, ops["other"].type, ops["other"].shape, ops["other"].logical_shape) == (
        "weight", OperationDataType.PARAM, (32, 16), (16, 32))
    assert (ops["bias"].name, ops["bias"].type, ops["bias"].logical_shape) == ("bias", OperationDataType.PARAM, (32,))
    assert (ops["output"].name, ops["output"].type, ops["output"].logical_shape) == (
        "linear", OperationDataType.OUTPUT, (64, 32))
    assert [(op.locator.kind, op.locator.key) for op in vector[0].operands] == [
        ("arg", 0), ("param", "weight"), ("param", "bias"), ("output", None)]


def test_function_op_data_mapping_locates_call_arguments():
    gm = trace(FunctionModel(), meta_args={"input": torch.empty(4, 4, 4, 16, device="meta"),
                                           "others": torch.empty(32, 16, device="meta"),
                                           "bias": torch.empty(32, device="meta")})
    vector = strategies_for_node(gm, "linear", DeviceMesh((2, 2)))
    ops = {op.role: op for op in vector[0].operands}
    assert (ops["other"].name, ops["other"].type, ops["other"].logical_shape) == ("others", OperationDataType.ARG,
                                                                                  (16, 32))
    assert (ops["other"].locator.kind, ops["other"].locator.key) == ("arg", 1)
    assert (ops["bias"].locator.kind, ops["bias"].locator.key) == ("kwarg", "bias")
    # activations (not parameters) get their partial gradients all-reduced BEFORE the op, not by a hook
    ss = vector.by_name("S0S1 = S0R x RS1_0")
    assert {(a.operand, a.where) for a in ss.communication_actions} == {
        ("input_1", CommWhere.BEFORE), ("others", CommWhere.BEFORE), ("bias", CommWhere.BEFORE)}


def colossal(names, count=24):
    """ColossalAI's ``count`` strategies: the generator offers them first, in its order, the replicated one last."""
    return names[:count - 1] + names[-1:]


def layout_key(strategy):
    return tuple(str(spec) for _, spec in strategy.sharding_specs), tuple(strategy.partial_inputs)


def test_reference_names_and_order_on_2d_mesh():
    _, vector = module_strategies((2, 2))
    assert colossal(vector.names) == REFERENCE_2D
    assert len({s.name for s in vector}) == len(vector) == len({layout_key(s) for s in vector}) == 69


def test_beyond_colossalai_every_order_every_placement_and_partial_inputs():
    """The layouts ColossalAI's families leave out: a reversed shard order, data parallel over
    one axis of a 2-D mesh, M over two leading dims, and inputs held as partial sums."""
    _, vector = module_strategies((2, 2))
    extra = vector.names[23:-1]
    for name in ("S10R = S10R x RR_0", "RR = RS10 x S10R", "RS10 = RR x RS10", "S0R = S0R x RR_2",
                 "S01R = S01R x RR_0,1", "S01R = S01R x RR_1,0", "RR = RR+P0 x RR+P1", "RR = RR+P01 x RR",
                 "RS1 = RR+P0 x RS1", "S0R = S0R x RR+P1_2"):
        assert name in extra, name
    assert "S10R = S10R x RR_1,0" not in extra        # the layout of S01R = S01R x RR_0,1
    partial = vector.by_name("RS1 = RR+P0 x RS1")
    assert [(p.operand, p.axes) for p in partial.partial_inputs] == [("input_1", (0,))]
    assert [(a.pattern, a.axes, a.operand, a.where) for a in partial.communication_actions] == [
        (CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, (1,), "input_1", CommWhere.BEFORE),
        (CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, (0,), "weight", CommWhere.HOOK),
        (CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, (0,), "linear", CommWhere.AFTER)]
    weight_piece = vector.by_name("RR = RR x RR+P1")
    assert [(a.pattern, a.axes, a.operand) for a in weight_piece.communication_actions] == [
        (CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, (1,), "input_1"),
        (CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, (1,), "linear")]


def test_every_family_gives_each_axis_to_one_dim_in_every_order():
    # sum over k used axes: C(n, k) ways to pick them, k! orders, C(k + 2, 2) ways to deal them to M, K, N
    for ndim, count in ((1, 4), (2, 19), (3, 106)):
        families = every_family(ndim)
        assert len(families) == len(set(families)) == count
        assert families[:len(logical_families(ndim))] == logical_families(ndim)


def test_a_one_element_dim_is_never_split():
    _, vector = module_strategies((2, 2), input_shape=(1, 4, 4, 16))
    expected = [n for n in REFERENCE_2D if not n.endswith("_0")]
    assert colossal(vector.names, len(expected)) == expected
    assert all(s.get_sharding_spec_by_name("input_1").partition_dict().get(0) is None for s in vector)


def test_with_bias_every_reference_strategy_is_kept_and_the_bias_is_added_after_the_reduce():
    _, vector = module_strategies((2, 2), bias=True)
    assert colossal(vector.names) == REFERENCE_2D
    # each of the 69 layouts; those reducing the output (40) once more with the bias as a partial
    # sum; those reducing nothing with an axis left free (8 with one, the replicated one with two:
    # 3 sets) with the bias a partial max or min over each set of those axes
    extremum = [s for s in vector if s.partial_input("bias") and s.partial_input("bias").op != "sum"]
    assert len(vector) == 69 + 40 + len(extremum) and len(extremum) == 2 * (8 + 3)
    assert "RS0 = RR x RS0, bias+Pmax1" in {s.name for s in extremum}
    for strategy in vector:
        assert str(strategy.get_sharding_spec_by_name("bias").sharding_sequence[-1]) == \
            str(strategy.get_sharding_spec_by_name("linear").sharding_sequence[-1])
        reduced = [a.axes for a in strategy.communication_actions if a.where is CommWhere.AFTER]
        if strategy in extremum:
            op = strategy.partial_input("bias").op
            assert strategy.name.endswith(f", bias+P{op}" + "".join(map(str, reduced[0])))
            assert [a.op for a in strategy.communication_actions if a.where is CommWhere.AFTER] == [op]
        elif strategy.partial_axes("bias"):
            assert strategy.name.endswith(", bias+P" + "".join(map(str, reduced[0])))
            assert [strategy.partial_axes("bias")] == reduced and not strategy.post_add, strategy.name
        else:
            assert bool(strategy.post_add) == bool(reduced), strategy.name
        if strategy.post_add:
            assert strategy.post_add[0].operand == "bias" and strategy.post_add[0].dims == (3,)


@pytest.mark.parametrize("mesh_shape,input_shape", [((2, 2), (4, 4, 4, 16)), ((4,), (8, 16)), ((1, 4), (4, 4, 16)),
                                                    ((2, 2, 2), (8, 4, 16)), ((2, 2), (16,))])
def test_layouts_agree_across_operands(mesh_shape, input_shape):
    _, vector = module_strategies(mesh_shape, input_shape)
    assert vector, "no strategy at all"
    for strategy in vector:
        x = strategy.get_sharding_spec_by_name("input_1").sharding_sequence
        w = strategy.get_sharding_spec_by_name("weight").sharding_sequence
        y = strategy.get_sharding_spec_by_name("linear").sharding_sequence
        assert x[:-1] == y[:-1], strategy.name
        assert w[1] == x[-1] and w[0] == y[-1], strategy.name


def test_one_dimensional_mesh_families():
    _, vector = module_strategies((4,), input_shape=(8, 2, 16))
    # dim 1 (2 rows over 4 ranks) is cut as DTensor cuts it: 1, 1, 0, 0
    assert vector.names == ["RR = RS0 x S0R", "RS0 = RR x RS0", "S0R = S0R x RR_0", "S0R = S0R x RR_1",
                            "RR = RR+P0 x RR", "RR = RR x RR+P0", "RR = RR x RR"]
    uneven = vector.names.index("S0R = S0R x RR_1")
    assert not vector[uneven].sharding_specs[0][1].is_even


def test_one_by_four_mesh_keeps_trivial_axis():
    _, vector = module_strategies((1, 4), input_shape=(2, 4, 16))
    # axis 0 has size 1 so S0 splits nothing; S1 and S01 (4 ranks) cut dim 0 of size 2 unevenly
    expected = [n for n in REFERENCE_2D if not n.endswith("_2")]
    assert colossal(vector.names, len(expected)) == expected
    assert not any(0 in p.axes for s in vector for p in s.partial_inputs)   # a partial sum over one rank is none


def test_three_dimensional_mesh_families():
    _, vector = module_strategies((2, 2, 2), input_shape=(8, 4, 16))
    names = vector.names
    pairs = list(itertools.permutations(range(3), 2))
    expected_logical = (
        [f"S{x}S{y} = S{x}R x RS{y}" for x, y in pairs] + [f"S{x}R = S{x}S{y} x S{y}R" for x, y in pairs]
        + [f"RS{y} = RS{x} x S{x}S{y}" for x, y in pairs] + [f"RR = RS{x} x S{x}R" for x in range(3)]
        + [f"RS{x} = RR x RS{x}" for x in range(3)] + ["S012R = S012R x RR", "RR = RS012 x S012R",
                                                     "RS012 = RR x RS012", "RR = RR x RR"])
    assert [logical_name(*t) for t in logical_families(3)] == expected_logical
    # batch-sharded families expand over the two leading dims; S012 (8 ranks) cuts dim 1 (4) unevenly
    assert "S0S2 = S0R x RS2_0" in names and "S0S2 = S0R x RS2_1" in names
    assert "S012R = S012R x RR_0" in names and "S012R = S012R x RR_1" in names
    colossal_count = 6 * 2 + 6 * 2 + 6 + 3 + 3 + 2 + 1 + 1 + 1
    assert [n for n in names[:colossal_count - 1] if "," not in n and "P" not in n] == names[:colossal_count - 1]
    assert len(names) == len({layout_key(s) for s in vector}) == 435


def test_comm_actions_follow_from_the_layout():
    _, vector = module_strategies((2, 2), bias=False)
    def actions(name):
        return [(a.pattern, a.axes, a.operand, a.where) for a in vector.by_name(name).communication_actions]
    IF, AF = CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, CommPattern.ALLREDUCE_FWD_IDENTITY_BWD
    assert actions("S0S1 = S0R x RS1_1") == [(IF, (1,), "input_1", CommWhere.BEFORE), (IF, (0,), "weight", CommWhere.HOOK)]
    assert actions("S1R = S1S0 x S0R_2") == [(IF, (1,), "weight", CommWhere.HOOK), (AF, (0,), "linear", CommWhere.AFTER)]
    assert actions("RS0 = RS1 x S1S0") == [(IF, (0,), "input_1", CommWhere.BEFORE), (AF, (1,), "linear", CommWhere.AFTER)]
    assert actions("S01R = S01R x RR_0") == [(IF, (0, 1), "weight", CommWhere.HOOK)]
    assert actions("RR = RS01 x S01R") == [(AF, (0, 1), "linear", CommWhere.AFTER)]
    assert actions("RR = RR x RR") == []


def _shard_counts(strategy):
    """Every operand's shard count per dim, in one flat tuple (operands in the strategy's order)."""
    return tuple(count for _, spec in strategy.sharding_specs for count in spec.shard_counts())


def _dominates(ca, cb):
    """Every operand with counts ``ca`` is split at least as finely as with ``cb``, one strictly more
    (the counts of :func:`_shard_counts`, taken once per strategy: 2x2x2 compares 400k pairs)."""
    pairs = list(zip(ca, cb))
    return all(x >= y for x, y in pairs) and any(x > y for x, y in pairs)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (4,), (1, 4), (2, 2, 2)])
def test_costs_positive_and_consistent(mesh_shape):
    _, vector = module_strategies(mesh_shape, input_shape=(8, 4, 16), bias=True)
    mesh = DeviceMesh(mesh_shape)
    for s in vector:
        assert s.compute_cost.fwd > 0 and s.compute_cost.bwd > 0
        assert s.compute_cost.total == s.compute_cost.fwd + s.compute_cost.bwd
        mem = s.memory_cost
        assert mem.fwd.activation > 0 and mem.fwd.parameter > 0
        assert mem.total.activation == mem.fwd.activation + mem.bwd.activation
        assert mem.total.parameter == mem.fwd.parameter + mem.bwd.parameter
        comm = s.communication_cost
        assert comm.total == pytest.approx(comm.fwd + comm.bwd)
        moves = any(mesh.axes_size(a.axes) > 1 for a in s.communication_actions)
        assert (comm.total > 0) == moves, s.name
    replicated = vector.by_name("RR = RR x RR")
    # layouts without partial inputs (those share their base's), even ones (uneven: rank 0's block)
    even = [s for s in vector if all(spec.is_even for _, spec in s.sharding_specs) and not s.partial_inputs]
    counts = {id(s): _shard_counts(s) for s in even}
    for a, b in itertools.permutations(even, 2):
        if _dominates(counts[id(a)], counts[id(b)]):
            assert a.memory_cost.total.activation + a.memory_cost.total.parameter < \
                b.memory_cost.total.activation + b.memory_cost.total.parameter, (a.name, b.name)
            assert a.compute_cost.fwd <= b.compute_cost.fwd
    assert all(s.compute_cost.fwd <= replicated.compute_cost.fwd for s in vector)


# ---- numerical check of the declared communication, ranks simulated one after another ----

@functools.lru_cache(maxsize=None)
def _group_ranks(mesh, rank, axes):
    """mesh.group_ranks, asked once per (mesh, rank, axes): the 2x2x2 case asks 25,000 times."""
    return mesh.group_ranks(rank, axes)


def _piece(strategy, mesh, rank, name, block):
    """``block``, or this rank's random piece of it where ``name`` is a partial sum: every rank
    draws the same pieces (seeded by the operand alone, so two ranks holding the same block hold
    the same pieces, as a multilinear op needs) and keeps the one at its place in its group."""
    axes = strategy.partial_axes(name)
    if not axes:
        return block.clone()
    group = _group_ranks(mesh, rank, tuple(axes))
    gen = torch.Generator().manual_seed(0)
    pieces = [torch.randn(block.shape, generator=gen, dtype=block.dtype) for _ in group[1:]]
    pieces.insert(0, block - sum(pieces))
    return pieces[list(group).index(rank)]


def _simulate(strategy, mesh, full, call, out_name, grad_out):
    """Run every rank on its local shards, apply the strategy's CommActions, return per-rank
    (output, {operand: grad}) as the ranks would hold them."""
    late = {add.operand for add in strategy.post_add}   # added after the reduce, not by the op
    locals_ = []
    for rank in mesh.ranks:
        leaves = {name: _piece(strategy, mesh, rank, name, spec.local_shard(full[name], mesh, rank)).requires_grad_()
                  for name, spec in strategy.sharding_specs if name != out_name}
        locals_.append((leaves, call({n: torch.zeros_like(v) if n in late else v for n, v in leaves.items()})))
    outputs = [out.detach() for _, out in locals_]
    for action in strategy.communication_actions:
        if action.where is CommWhere.AFTER:
            assert action.pattern is CommPattern.ALLREDUCE_FWD_IDENTITY_BWD
            outputs = [sum(outputs[g] for g in _group_ranks(mesh, r, action.axes)) for r in mesh.ranks]
    outputs = [out + sum(locals_[r][0][n].detach() for n in late) for r, out in enumerate(outputs)]
    out_spec = strategy.get_sharding_spec_by_name(out_name)
    for rank, (leaves, out) in enumerate(locals_):  # identity backward through the AFTER all-reduce
        (out + sum(leaves[n] for n in late)).backward(out_spec.local_shard(grad_out, mesh, rank))
    grads = [{n: leaf.grad for n, leaf in leaves.items()} for leaves, _ in locals_]
    reduced = [dict(g) for g in grads]
    for action in strategy.communication_actions:
        if action.where in (CommWhere.BEFORE, CommWhere.HOOK):
            assert action.pattern is CommPattern.IDENTITY_FWD_ALLREDUCE_BWD
            for r in mesh.ranks:
                reduced[r][action.operand] = sum(grads[g][action.operand] for g in _group_ranks(mesh, r, action.axes))
    return outputs, reduced


@pytest.mark.parametrize("mesh_shape,bias", [((2, 2), False), ((2, 2), True), ((2, 2, 2), True), ((4,), True)])
def test_every_strategy_is_numerically_exact_with_its_comm_actions(mesh_shape, bias):
    torch.manual_seed(0)
    mesh = DeviceMesh(mesh_shape)
    _, vector = module_strategies(mesh_shape, input_shape=(8, 4, 16), bias=bias)
    full = {"input_1": torch.randn(8, 4, 16, dtype=torch.float64),
            "weight": torch.randn(32, 16, dtype=torch.float64), "bias": torch.randn(32, dtype=torch.float64)}
    leaves = {k: v.clone().requires_grad_() for k, v in full.items()}
    call = (lambda t: F.linear(t["input_1"], t["weight"], t.get("bias"))) if bias else \
        (lambda t: F.linear(t["input_1"], t["weight"]))
    ref = call(leaves)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    # the bias as a partial max or min: the verifier checks those (generated_tests/test_linear*.py);
    # this simulation models only sums, whose backward hands every rank the whole gradient
    for strategy in [s for s in vector if all(p.op == "sum" for p in s.partial_inputs)]:
        outputs, grads = _simulate(strategy, mesh, full, call, "linear", grad_out)
        pairs = []   # (what, as the ranks hold it, as the single device computed it)
        for rank in mesh.ranks:
            spec = strategy.get_sharding_spec_by_name("linear")
            pairs.append((f"output on rank {rank}", outputs[rank], spec.local_shard(ref.detach(), mesh, rank)))
            for name, grad in grads[rank].items():
                expected = strategy.get_sharding_spec_by_name(name).local_shard(leaves[name].grad, mesh, rank)
                pairs.append((f"grad of {name} on rank {rank}", grad, expected))
        _assert_all_close(strategy.name, pairs)


def _assert_all_close(name, pairs):
    """torch.testing.assert_close over every pair, in one comparison while all agree (the 2x2x2
    case compares 24,000 blocks, and assert_close's own bookkeeping was most of its time); on a
    difference, assert_close of each pair names the first that differs."""
    if all(actual.shape == expected.shape and actual.dtype == expected.dtype for _, actual, expected in pairs) and \
            torch.allclose(torch.cat([actual.reshape(-1) for _, actual, _ in pairs]),
                           torch.cat([expected.reshape(-1) for _, _, expected in pairs]),
                           rtol=1e-7, atol=1e-7):   # assert_close's bounds for float64, elementwise
        return
    for what, actual, expected in pairs:
        torch.testing.assert_close(actual, expected, msg=f"{name}: {what}")
    raise AssertionError(f"{name}: the blocks' shapes, dtypes or values differ")


def test_dropping_an_action_breaks_the_numbers():
    """The simulation above can fail: a strategy missing its all-reduce is caught."""
    mesh = DeviceMesh((2, 2))
    _, vector = module_strategies((2, 2), input_shape=(8, 4, 16))
    strategy = vector.by_name("S0R = S0S1 x S1R_0").replace(communication_actions=())
    full = {"input_1": torch.randn(8, 4, 16, dtype=torch.float64), "weight": torch.randn(32, 16, dtype=torch.float64)}
    call = lambda t: F.linear(t["input_1"], t["weight"])  # noqa: E731
    ref = call(full)
    outputs, _ = _simulate(strategy, mesh, full, call, "linear", torch.ones_like(ref))
    assert not torch.allclose(outputs[0], strategy.output_sharding_spec.local_shard(ref, mesh, 0))


def test_api_errors_name_the_problem():
    gm, _ = module_strategies((2, 2))
    with pytest.raises(InvalidArgument, match="'nope'"):
        strategies_for_node(gm, "nope", DeviceMesh((2, 2)))
    with pytest.raises(InvalidArgument, match="out of range"):
        strategies_for_node(gm, 7, DeviceMesh((2, 2)))
    with pytest.raises(InvalidArgument, match="DeviceMesh"):
        strategies_for_node(gm, 1, (2, 2))
    assert strategies_for_node(gm, 1, DeviceMesh((2, 2))) is strategies_for_node(gm, "linear", DeviceMesh((2, 2)))


def test_node_without_handler_is_an_error():
    class Sinc(torch.nn.Module):
        def forward(self, x):
            return torch.sinc(x)
    gm = trace(Sinc(), meta_args={"x": torch.empty(4, device="meta")})
    with pytest.raises(HandlerError, match="no handler for node 'sinc'"):
        strategies_for_node(gm, "sinc", DeviceMesh((2,)))


def test_naming_colossalai_is_a_rule_option_checked_at_load_and_on_the_rule():
    """The option lives in the rules engine: a bad value is refused at load, and a rule that is
    no [..M.., K] x (K, N) contraction (bmm's batch held by both factors) is refused per call."""
    from shardverify.errors import StrategyError
    from shardverify.strategies.rules.colossal import contraction
    from shardverify.strategies.rules.notation import parse_equation
    from shardverify.strategies.rules.rule import bind
    from shardverify.strategies.rules.sources import parse_rule

    assert parse_rule({"einsum": "mk,nk->mn", "naming": "colossalai"}).modifiers.naming == "colossalai"
    with pytest.raises(InvalidArgument, match="'naming'"):
        parse_rule({"einsum": "mk,nk->mn", "naming": "megatron"})
    linear = bind(parse_equation("... k, n k -> ... n"), [(4, 3, 16), (32, 16)], [(4, 3, 32)])
    assert contraction(linear).k == "k" and contraction(linear).n == "n" and len(contraction(linear).m) == 2
    bmm = bind(parse_equation("bmk,bkn->bmn"), [(2, 4, 8), (2, 8, 4)], [(2, 4, 4)])
    with pytest.raises(StrategyError, match="naming colossalai needs"):
        contraction(bmm)
