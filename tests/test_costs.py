"""Declared costs are checked: communication priced from the collectives a rank really issued,
compute from the FLOPs of the real local op call (rule: generators.common.compute_cost)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from shardverify import DeviceMesh
from shardverify.strategies.for_node import strategies_for_node
from shardverify.backends import SimulatedBackend
from shardverify.strategies.generators.common import action_traffic, compute_cost, op_call_shapes
from shardverify.sharding.strategy import CommAction, CommPattern, CommWhere, TrainCycleItem
from shardverify.spec.case import InputDecl, ModuleDecl, OpCase
from shardverify.verify.costs import OpMeter, price_traffic
from shardverify.verify.engine import verify_case, verify_strategy

INPUT = (InputDecl("input", (4, 4, 4, 16)),)
LINEAR = OpCase(op="linear", target="torch.nn.Linear", inputs=INPUT,
                module=ModuleDecl("torch.nn.Linear", (16, 32), (("bias", False),)))
SUM = OpCase(op="sum", target="torch.sum", inputs=INPUT, params=(("dim", (0, 2)), ("keepdim", False)),
             predecessor=ModuleDecl("torch.nn.Linear", (16, 32), (("bias", False),)))


@pytest.fixture(scope="module")
def mesh22():
    with SimulatedBackend(DeviceMesh((2, 2)), timeout=30) as backend:
        yield backend


def generated(case, mesh):
    graph_module, node_name = case.build()
    return list(strategies_for_node(graph_module, node_name, mesh))


def row_parallel(mesh):
    """The contraction-sharded linear strategy: its output is all-reduced after the op."""
    return next(s for s in generated(LINEAR, mesh) if any(a.where is CommWhere.AFTER for a in s.communication_actions))


def cost_details(result) -> list[str]:
    return [m.detail for m in result.mismatches if m.kind == "cost"]


def test_rule_halves_counted_flops_else_takes_the_largest_operand():
    assert compute_cost(2 * 64 * 16 * 32, [1024, 512]) == TrainCycleItem(32768.0, 65536.0, 98304.0)
    assert compute_cost(0, [2048, 32]) == TrainCycleItem(2048.0, 4096.0, 6144.0)


def test_meter_counts_the_real_call():
    meter = OpMeter()
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    assert torch.equal(meter.call(torch.mm, a, b), a @ b)
    assert (meter.work.flops, meter.work.largest_numel) == (2 * 8 * 4 * 3, 32)
    meter.call(torch.sum, a, 0)
    assert (meter.work.flops, meter.work.largest_numel) == (0, 32)


def test_zero_declared_communication_fails_naming_both_figures(mesh22):
    strategy = row_parallel(mesh22.mesh)
    declared = strategy.communication_cost
    assert declared.fwd > 0
    result = verify_strategy(mesh22, LINEAR, strategy.replace(communication_cost=TrainCycleItem(0.0, 0.0, 0.0)))
    assert not result.passed and {m.kind for m in result.mismatches} == {"cost"}
    detail = cost_details(result)[0]
    assert f"strategy {strategy.name!r}" in detail
    assert re.search(rf"fwd: declared 0 s, expected {declared.fwd:.6g} s", detail), detail
    assert "all_reduce of" in detail and "communication cost" in result.report()


def test_wrong_backward_communication_names_the_phase(mesh22):
    strategy = next(s for s in generated(LINEAR, mesh22.mesh) if s.communication_cost.bwd > 0)
    c = strategy.communication_cost
    wrong = TrainCycleItem(c.fwd, c.bwd * 3, c.fwd + c.bwd * 3)
    detail = cost_details(verify_strategy(mesh22, LINEAR, strategy.replace(communication_cost=wrong)))[0]
    assert f"bwd: declared {wrong.bwd:.6g} s, expected {c.bwd:.6g} s" in detail
    assert "fwd:" not in detail


def test_wrong_compute_cost_fails_naming_both_figures(mesh22):
    strategy = generated(LINEAR, mesh22.mesh)[0]
    right = strategy.compute_cost
    wrong = TrainCycleItem(right.fwd * 2, right.bwd, right.fwd * 2 + right.bwd)
    result = verify_strategy(mesh22, LINEAR, strategy.replace(compute_cost=wrong))
    assert [m.kind for m in result.mismatches] == ["cost"] * 4   # every rank measures its own call
    detail = cost_details(result)[0]
    assert f"fwd: declared {wrong.fwd:.6g}, expected {right.fwd:.6g}" in detail
    assert "bwd:" not in detail and "FLOPs counted / 2" in detail


def test_uncounted_op_expects_the_largest_operand(mesh22):
    strategy = generated(SUM, mesh22.mesh)[0]
    old_rule = TrainCycleItem(strategy.compute_cost.fwd, strategy.compute_cost.fwd, 2 * strategy.compute_cost.fwd)
    detail = cost_details(verify_strategy(mesh22, SUM, strategy.replace(compute_cost=old_rule)))[0]
    assert "no FLOPs counted: largest local operand has" in detail and "bwd: declared" in detail


@pytest.mark.parametrize("mesh_shape", [(2, 2), (4,)])
@pytest.mark.parametrize("case", [LINEAR, SUM, OpCase(op="linear", target="torch.nn.Linear", inputs=INPUT,
                                                       module=ModuleDecl("torch.nn.Linear", (16, 32)))],
                         ids=["linear", "sum", "linear-bias"])
def test_every_generated_strategy_declares_what_it_measures(mesh_shape, case):
    with SimulatedBackend(DeviceMesh(mesh_shape), timeout=30) as backend:
        results = verify_case(backend, case)
    assert results and all(r.passed for r in results), [r.report() for r in results if not r.passed]


def test_declared_traffic_follows_the_shapes_through_chained_actions():
    mesh = DeviceMesh((2, 4))
    strategy = generated(LINEAR, mesh)[0]
    operands = {d.name: d for d in strategy.operands}
    specs = dict(strategy.sharding_specs)
    name = strategy.operands[0].name
    local = specs[name].local_numel() * 4
    gather = CommAction(CommPattern.GATHER_FWD_SPLIT_BWD, (1,), name, CommWhere.BEFORE, (0,))
    split = CommAction(CommPattern.SPLIT_FWD_GATHER_BWD, (0,), name, CommWhere.BEFORE, (1,))
    traffic = action_traffic(mesh, [gather, split], operands, specs)
    # gathered over 4 ranks, then split in 2: the backward gather moves the split shard
    assert traffic == [("fwd", "all_gather", (1,), local), ("bwd", "all_gather", (0,), local * 4 // 2)]
    shapes = op_call_shapes(mesh, strategy.operands, specs, [gather, split])
    in_shape = specs[name].local_shape()
    assert shapes[name] == (in_shape[0] * 4, in_shape[1] // 2) + in_shape[2:]


def test_priced_traffic_uses_the_mesh_model():
    mesh = DeviceMesh((2, 4), alpha=(1e-5, 2e-5), beta=(1e-9, 3e-9))
    traffic = Counter({("all_reduce", (0,), 1000): 2, ("all_gather", (1,), 100): 1})
    expected = 2 * mesh.all_reduce_cost(1000, (0,)) + mesh.all_gather_cost(400, (1,))
    assert price_traffic(mesh, traffic) == pytest.approx(expected)


@pytest.mark.parametrize("target, op", [("torch.amax", "max"), ("torch.mean", "avg"), ("torch.sum", "sum")])
def test_partial_reductions_declare_their_backward_collectives(mesh22, target, op):
    """A reduced dim kept sharded: the partial output is all-reduced with ``op``; max/min also
    all-reduce once in backward (to find the holders), which the declared cost must include."""
    from shardverify.strategies.generators.common import with_declared_costs
    from shardverify.sharding.sharding_spec import ShardingSpec
    from shardverify.sharding.strategy import OperandLocator, OperationData, OperationDataType, ShardingStrategy

    case = OpCase(op=target, target=target, inputs=INPUT, params=(("dim", (0,)), ("keepdim", False)),
                  predecessor=ModuleDecl("torch.nn.Linear", (16, 32), (("bias", False),)))
    graph_module, node_name = case.build()
    node = next(n for n in graph_module.graph.nodes if n.name == node_name)
    producer = node.args[0]
    inp = OperationData(producer.name, OperationDataType.ARG, "input", (4, 4, 4, 32), torch.float32,
                        locator=OperandLocator("arg", 0))
    out = OperationData(node_name, OperationDataType.OUTPUT, "output", (4, 4, 32), torch.float32,
                        locator=OperandLocator("output"))
    mesh = mesh22.mesh
    specs = {inp.name: ShardingSpec.from_partition(mesh.shape, inp.shape, {0: (0,)}),
             out.name: ShardingSpec.from_partition(mesh.shape, out.shape, {})}
    action = CommAction(CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, (0,), out.name, CommWhere.AFTER, op=op)
    draft = ShardingStrategy(name=f"partial {op}", sharding_specs=tuple(specs.items()), operands=(inp, out),
                             compute_cost=TrainCycleItem(0, 0, 0), memory_cost=strategy_memory(inp, out, specs),
                             communication_cost=TrainCycleItem(0, 0, 0), communication_actions=(action,))
    strategy = with_declared_costs(draft, graph_module, node_name, mesh)
    assert (strategy.communication_cost.bwd > 0) == (op == "max")
    result = verify_strategy(mesh22, case, strategy)
    assert result.passed, result.report()
    wrong = strategy.replace(communication_cost=TrainCycleItem(strategy.communication_cost.fwd, 0.0,
                                                               strategy.communication_cost.fwd))
    assert verify_strategy(mesh22, case, wrong).passed == (op != "max")


def strategy_memory(inp, out, specs):
    from shardverify.strategies.generators.common import memory_cost

    return memory_cost((inp, out), specs)


# ------------------------------------------------------------- an op that gives no gradient

COMPARE = OpCase(op="compare", target="torch.lt", inputs=(InputDecl("input", (8, 4, 6)), InputDecl("other", (4, 1))))


def _broadcast_sharded(mesh):
    """lt's strategy sharding ``input``'s dim 0, ``other`` (broadcast there) replicated."""
    return next(s for s in generated(COMPARE, mesh) if s.name.startswith("S0RR x RR"))


def test_an_op_without_gradient_declares_no_backward_sync_or_cost():
    for strategy in generated(COMPARE, DeviceMesh((4,))):
        assert not strategy.communication_actions and strategy.communication_cost == TrainCycleItem(0.0, 0.0, 0.0), \
            strategy.name


def test_backward_cost_mutants_of_an_op_without_gradient_fail():
    """The bool output of lt carries no gradient, so no backward collective runs: a declared
    backward cost, or a declared gradient all-reduce of the broadcast operand, is wrong."""
    with SimulatedBackend(DeviceMesh((4,)), timeout=30) as backend:
        right = _broadcast_sharded(backend.mesh)
        priced = right.replace(communication_cost=TrainCycleItem(0.0, 6e-5, 6e-5))
        synced = right.replace(communication_actions=(
            CommAction(CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, (0,), "other", CommWhere.BEFORE),))
        results = verify_case(backend, COMPARE, [right, priced, synced])
    assert [r.passed for r in results] == [True, False, False]
    assert "bwd: declared 6e-05 s, expected 0 s for the collectives issued (no collectives)" in \
        cost_details(results[1])[0]
    assert "declares a backward all-reduce of the gradient of 'other', but no output of the op carries a gradient" \
        in results[2].mismatches[0].detail


def test_strategies_alike_in_layout_but_not_in_declared_cost_are_checked_apart(mesh22):
    strategy = row_parallel(mesh22.mesh)
    zero = strategy.replace(name=strategy.name + " (declared free)", communication_cost=TrainCycleItem(0.0, 0.0, 0.0))
    results = verify_case(mesh22, LINEAR, [strategy, zero])
    assert [r.passed for r in results] == [True, False]


def test_counting_flops_imports_no_compiler():
    """The counter counts as torch's FlopCounterMode without importing torch._dynamo (which
    torch's mode imports at the first op it counts, 2 CPU-s of a one-op `shardverify verify`)."""
    import subprocess
    import sys

    from torch.utils.flop_counter import FlopCounterMode

    # torch's own count here, where torch._dynamo may be loaded already: the process below must
    # not load it, and importing it there would be 2 CPU-s more
    a, b = torch.empty(8, 16, device="meta"), torch.empty(16, 4, device="meta")
    with FlopCounterMode(display=False) as theirs:
        torch.mm(a, b)
    code = ("import sys, torch\n"
            "from torch.utils.flop_counter import FlopCounterMode\n"
            "from shardverify.strategies.generators.flops import LocalFlopCounter\n"
            "a, b = torch.empty(8, 16, device='meta'), torch.empty(16, 4, device='meta')\n"
            "with LocalFlopCounter() as mine:\n    torch.mm(a, b)\n"
            "print(mine.get_total_flops(), 'torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(theirs.get_total_flops()), "False"] == ["1024", "False"]


def test_a_threads_counter_is_made_once_and_counts_each_call_alone():
    """A generator's meta calls share one counter per thread, cleared as each call is counted; a
    call counted within a counted call gets a counter of its own, and so does another thread."""
    import threading

    from shardverify.strategies.generators.flops import thread_counter

    a, b = torch.empty(8, 16, device="meta"), torch.empty(16, 4, device="meta")
    first = thread_counter()
    with first as counter:
        torch.mm(a, b)
        inner = thread_counter()
        assert inner is not first
        with inner:
            torch.mm(a, a.T)
        assert inner.get_total_flops() == 2 * 8 * 16 * 8
    assert counter.get_total_flops() == 1024 + 2 * 8 * 16 * 8    # the outer mode saw the inner call too
    assert thread_counter() is first
    with thread_counter() as again:
        torch.mm(a, b)
    assert again is first and again.get_total_flops() == 1024    # not the last call's count added
    elsewhere = []
    worker = threading.Thread(target=lambda: elsewhere.append(thread_counter()))
    worker.start()
    worker.join()
    assert elsewhere[0] is not first
