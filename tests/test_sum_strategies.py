"""Strategies of the sum handler (the rules engine with follow: input)."""

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from shardverify import DeviceMesh, StrategyError, strategies_for_node, trace
from shardverify.strategies.rules.derive import normalize_dims


class LinearThen(torch.nn.Module):
    def __init__(self, reduce):
        super().__init__()
        self.linear = torch.nn.Linear(16, 32, bias=False)
        self.reduce = reduce

    def forward(self, input):
        return self.reduce(self.linear(input))


def sum_strategies(reduce, mesh_shape=(2, 2), input_shape=(4, 4, 4, 16)):
    gm = trace(LinearThen(reduce), meta_args={"input": torch.empty(input_shape, device="meta")})
    node = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")][0]
    mesh = DeviceMesh(mesh_shape)
    return strategies_for_node(gm, "linear", mesh), strategies_for_node(gm, node.name, mesh), node.name


def expected_names(pred_output_seq: str, dims, keepdim, index) -> list[str]:
    """The reference naming, written independently on sequence strings: the gathered strategy,
    then the partial one when the predecessor shards a reduced dim."""
    items = pred_output_seq.strip("[]").split(", ")
    inp = ["R" if d in dims else s for d, s in enumerate(items)]
    out = ["R" if d in dims else s for d, s in enumerate(items)] if keepdim else \
        [s for d, s in enumerate(items) if d not in dims]
    names = [f"[{', '.join(inp)}] -> [{', '.join(out)}]_{index}"]
    partial = sorted(int(axis) for d, s in enumerate(items) if d in dims and s != "R" for axis in s[1:])
    if partial:
        names.append(f"[{', '.join(items)}] -> [{', '.join(out)}] | P{''.join(map(str, partial))} sum_{index}")
    return names


def expected_pieces(pred_output_seq: str, dims, keepdim, index, mesh_axes=(0, 1)) -> list[str]:
    """The same strategies again with the input a partial sum over each set of free mesh axes."""
    items = pred_output_seq.strip("[]").split(", ")
    inp = ["R" if d in dims else s for d, s in enumerate(items)]
    out = ["R" if d in dims else s for d, s in enumerate(items)] if keepdim else \
        [s for d, s in enumerate(items) if d not in dims]
    partial = sorted(int(axis) for d, s in enumerate(items) if d in dims and s != "R" for axis in s[1:])
    names = []
    for layout, reduced in [(inp, [])] + ([(items, partial)] if partial else []):
        used = {int(axis) for s in layout if s != "R" for axis in s[1:]}
        free = [a for a in mesh_axes if a not in used]
        for held in [h for k in range(1, len(free) + 1) for h in itertools.combinations(free, k)]:
            both = "".join(map(str, sorted(set(held) | set(reduced))))
            names.append(f"[{', '.join(layout)}]+P{''.join(map(str, held))} -> [{', '.join(out)}] | P{both} sum_{index}")
    return names


def first_of_each(names):
    found = {}
    for name in names:
        found.setdefault(name.rpartition("_")[0], name)
    return list(found.values())


@pytest.mark.parametrize("reduce,dims,keepdim", [
    (lambda y: torch.sum(y, dim=(0, 2)), (0, 2), False),
    (lambda y: y.sum(dim=(-4, -2)), (0, 2), False),
    (lambda y: torch.sum(y, (0, 2), True), (0, 2), True),
    (lambda y: y.sum(1, keepdim=True), (1,), True),
    (lambda y: y.sum(-1), (3,), False),
    (lambda y: torch.sum(y), (0, 1, 2, 3), False),
    (lambda y: y.sum(dim=[]), (0, 1, 2, 3), False),
])
def test_per_predecessor_strategy_in_order_a_gathered_and_a_partial_one(reduce, dims, keepdim):
    """One gathered strategy per Linear strategy, in its order, identical layouts included
    (ColossalAI's contract, spec option ``naming: colossalai``), needing no communication; then
    each partial sibling, keeping the shards of the reduced dims and all-reducing (sum) over
    exactly their mesh axes after the op, and the partial-input pieces, each layout once."""
    linear, vector, node_name = sum_strategies(reduce)
    assert len(linear) == 69
    produced = [str(p.get_sharding_spec_by_name("linear").sharding_sequence) for p in linear]
    gathered = [expected_names(seq, dims, keepdim, i)[0] for i, seq in enumerate(produced)]
    names = gathered + first_of_each(
        [name for i, seq in enumerate(produced) for name in expected_names(seq, dims, keepdim, i)[1:]]
        + [name for i, seq in enumerate(produced) for name in expected_pieces(seq, dims, keepdim, i)])
    assert vector.names == names and any(s.partial_inputs for s in vector)
    assert len(set(gathered)) == len(gathered) > len({name.rpartition("_")[0] for name in gathered})
    for strategy in vector:
        assert [op.name for op in strategy.operands] == ["linear", node_name]
        if " | P" not in strategy.name:
            assert strategy.communication_actions == ()
            continue
        action, = strategy.communication_actions
        axes = tuple(int(a) for a in strategy.name.split(" | P")[1].split()[0])
        assert (action.pattern.name, action.where.name, action.operand, action.axes, action.op) == \
            ("ALLREDUCE_FWD_IDENTITY_BWD", "AFTER", node_name, axes, "sum")


def test_reference_example():
    _, vector, _ = sum_strategies(lambda y: torch.sum(y, dim=(0, 2)))
    strategy = vector.names.index("[R, S0, R, S1] -> [S0, S1]_1")
    assert str(vector[strategy].get_sharding_spec_by_name("sum_1").sharding_sequence) == "[S0, S1]"
    assert str(vector[strategy].get_sharding_spec_by_name("linear").sharding_sequence) == "[R, S0, R, S1]"


@pytest.mark.parametrize("mesh_shape", [(2, 2), (4,), (1, 4), (2, 2, 2)])
def test_costs_positive_and_consistent(mesh_shape):
    _, vector, _ = sum_strategies(lambda y: y.sum(dim=1), mesh_shape=mesh_shape, input_shape=(8, 4, 16))
    assert vector
    for s in vector:
        assert s.compute_cost.fwd > 0 and s.compute_cost.total == s.compute_cost.fwd + s.compute_cost.bwd
        assert s.memory_cost.fwd.activation > 0 and s.memory_cost.fwd.parameter == 0
        assert (s.communication_cost.total > 0) == bool(s.communication_actions)
    most = max(vector, key=lambda s: s.get_sharding_spec_by_name("linear").local_numel())
    least = min(vector, key=lambda s: s.get_sharding_spec_by_name("linear").local_numel())
    if most.get_sharding_spec_by_name("linear").local_numel() > least.get_sharding_spec_by_name("linear").local_numel():
        assert least.memory_cost.total.activation < most.memory_cost.total.activation


@pytest.mark.parametrize("dims,keepdim", [((0, 2), False), ((1,), True), (None, False)])
def test_local_sums_are_the_output_shards(dims, keepdim):
    """Each rank's local sum is exactly its output shard, or, for a partial strategy, the sum
    of the local sums over its all-reduce group is."""
    mesh = DeviceMesh((2, 2))
    reduce = (lambda y: torch.sum(y)) if dims is None else (lambda y: torch.sum(y, dims, keepdim))
    _, vector, name = sum_strategies(reduce)
    x = torch.randn(4, 4, 4, 32, dtype=torch.float64)
    ref = reduce(x)
    for s in vector:
        in_spec, out_spec = s.get_sharding_spec_by_name("linear"), s.get_sharding_spec_by_name(name)
        axes = s.communication_actions[0].axes if s.communication_actions else ()
        for rank in mesh.ranks:
            group = next(g for g in mesh.groups(axes) if rank in g) if axes else [rank]
            local = sum(reduce(_held(s, mesh, r, in_spec.local_shard(x, mesh, r))) for r in group)
            torch.testing.assert_close(local, out_spec.local_shard(ref, mesh, rank), msg=f"{s.name} rank {rank}")


def _held(strategy, mesh, rank, block):
    """What ``rank`` holds of its block: the block, or its random piece where the input is a
    partial sum (the same pieces on every rank, seeded alike; they sum to the block)."""
    axes = strategy.partial_axes("linear")
    if not axes:
        return block
    group = list(mesh.group_ranks(rank, axes))
    gen = torch.Generator().manual_seed(0)
    pieces = [torch.randn(block.shape, generator=gen, dtype=block.dtype) for _ in group[1:]]
    return ([block - sum(pieces)] + pieces)[group.index(rank)]


def test_a_partial_sum_without_its_all_reduce_or_with_another_op_is_caught():
    from shardverify.backends import SimulatedBackend
    from shardverify.spec.catalogue import load_op_specs
    from shardverify.verify.engine import verify_case

    spec, = load_op_specs(Path(__file__).resolve().parents[1], None, ["sum"])
    case = dict(spec.op_cases())["torch.sum-dim_0.2-keepdim_False"]
    graph_module, node = case.build()
    with SimulatedBackend(DeviceMesh((2, 2))) as backend:
        partial = [s for s in strategies_for_node(graph_module, node, backend.mesh) if " | P" in s.name]
        forgotten = [s.replace(communication_actions=()) for s in partial]
        as_max = [s.replace(communication_actions=tuple(dataclasses.replace(a, op="max")
                                                        for a in s.communication_actions)) for s in partial]
        results = [verify_case(backend, case, chosen) for chosen in (partial, forgotten, as_max)]
    good, without, wrong_op = results
    assert partial and all(r.passed for r in good)
    assert all(not r.passed and "output" in r.report() for r in without + wrong_op)
    assert {r.strategy for r in without} == {s.name for s in partial}


def test_reduce_op_is_validated():
    from shardverify.errors import InvalidArgument
    from shardverify.strategies.rules.sources import parse_rule

    with pytest.raises(InvalidArgument, match="reduce_op must be one of .*got 'mean'"):
        parse_rule({"follow": "input", "reduce_dims_param": "dim", "reduce_op": "mean"})


def test_sum_of_a_graph_input_takes_every_layout_the_input_can_arrive_in():
    """A graph input's node is replicated, but a plan may lay it out any way (a local slice):
    the sum offers every layout of the input's shape, each verified at the call."""
    from shardverify.verify.on_demand import verify_node

    class Sum(torch.nn.Module):
        def forward(self, x):
            return x.sum(0)
    gm = trace(Sum(), meta_args={"x": torch.empty(4, 6, device="meta")})
    vector = strategies_for_node(gm, "sum_1", DeviceMesh((2,)))
    assert vector.names == ["[R, R] -> [R]_0", "[R, R] -> [R]_1", "[R, S0] -> [S0]_2",
                            "[S0, R] -> [R] | P0 sum_1", "[R, R]+P0 -> [R] | P0 sum_0"]
    assert strategies_for_node(gm, "x", DeviceMesh((2,))).names == ["Replica Placeholder"]
    for mesh in (DeviceMesh((2, 2)), DeviceMesh((3,))):   # both shard orders; 4 and 6 over 3: uneven blocks
        results = verify_node(gm, "sum_1", mesh)
        assert len(results) == len(strategies_for_node(gm, "sum_1", mesh)) >= 4
        assert all(r.passed for r in results), [r.strategy for r in results if not r.passed]


def test_normalize_dims():
    assert normalize_dims(None, 3) == (0, 1, 2)
    assert normalize_dims((), 3) == (0, 1, 2)
    assert normalize_dims(-1, 3) == (2,)
    assert normalize_dims([2, -3], 3) == (0, 2)
    with pytest.raises(StrategyError, match="dim 3 is out of range"):
        normalize_dims((3,), 3)
    with pytest.raises(StrategyError, match="twice"):
        normalize_dims((0, -3), 3)
    with pytest.raises(StrategyError, match="'a'"):
        normalize_dims(("a",), 3)


def test_a_following_op_declared_linear_that_is_not_is_caught_at_its_partial_inputs():
    """sum's handler, with its ``linear_in``, planted on amax (partial results combined by max):
    the max of pieces is not a piece of the max, so exactly the strategies taking a partial
    input fail, each naming the output; the true sum passes them all."""
    from shardverify.backends import SimulatedBackend
    from shardverify.spec.catalogue import load_op_specs
    from shardverify.strategies.handlers import base
    from shardverify.strategies.rules.sources import parse_rule
    from shardverify.verify.engine import verify_case

    spec, = load_op_specs(Path(__file__).resolve().parents[1], None, ["sum"])
    case = dict(spec.op_cases())["torch.sum-dim_1-keepdim_False"]
    planted = dataclasses.replace(base._REGISTRY[torch.sum][0], name="planted_amax", targets=(torch.amax,),
                                  rule=parse_rule(dict(spec.options) | {"reduce_op": "max"}))
    saved = base._REGISTRY[torch.amax]
    base._REGISTRY[torch.amax] = (planted,)
    try:
        with SimulatedBackend(DeviceMesh((2, 2))) as backend:
            results = verify_case(backend, dataclasses.replace(case, op="amax", target="torch.amax"))
            true_sum = verify_case(backend, case)
    finally:
        base._REGISTRY[torch.amax] = saved
    failed = {r.strategy for r in results if not r.passed}
    assert failed and failed == {r.strategy for r in results if "+P" in r.strategy}
    assert all("output" in r.report() for r in results if not r.passed)
    assert all(r.passed for r in true_sum) and any("+P" in r.strategy for r in true_sum)


def test_a_following_op_reads_its_producers_layouts_without_costing_them():
    """sum reads only the layouts of the Linear's strategies: listing sum's builds them without
    costs, kept apart from the Linear's own (costed, the same layouts in the same order), and
    sum's strategies are the same whichever of the two it read."""
    from shardverify.strategies.for_node import CACHE_KEY, LAYOUTS_ONLY

    def traced():
        return trace(LinearThen(lambda y: y.sum(dim=1)), meta_args={"input": torch.empty((4, 4, 16), device="meta")})

    mesh = DeviceMesh((2, 2))
    gm = traced()
    node = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")][0]
    following = strategies_for_node(gm, node.name, mesh)
    linear = next(n for n in gm.graph.nodes if n.name == "linear")
    (key, sketches), = linear.meta[CACHE_KEY].items()
    assert key[-1] == LAYOUTS_ONLY and all(s.compute_cost.total == 0 for s in sketches)
    costed = strategies_for_node(gm, "linear", mesh)
    assert all(s.compute_cost.total > 0 for s in costed)
    assert [s.output_sharding_spec for s in sketches] == [s.output_sharding_spec for s in costed]

    again = traced()     # the Linear's costed strategies first: sum reads those
    strategies_for_node(again, "linear", mesh)
    assert [s.name for s in strategies_for_node(again, node.name, mesh)] == following.names
