"""The verification engine: cases, tolerances, reports, and verify_case on the simulated mesh."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from shardverify import DeviceMesh
from shardverify.strategies.for_node import strategies_for_node
from shardverify.backends import SimulatedBackend
from shardverify.errors import InvalidArgument, RankTimeout
from shardverify.sharding.strategy import CommAction, CommPattern, CommWhere, MemoryCost, MemoryCycle, ShardingStrategy
from shardverify.verify import engine
from shardverify.spec.case import InputDecl, ModuleDecl, OpCase
from shardverify.verify.engine import expected_collectives, verify_case, verify_strategy
from shardverify.verify.report import CheckResult, Mismatch, assert_passed, format_results
from shardverify.verify.tolerance import Tolerance, compare, tolerance_for

INPUT = (InputDecl("input", (4, 4, 4, 16)),)
LINEAR = OpCase(op="linear", target="torch.nn.Linear", inputs=INPUT,
                module=ModuleDecl("torch.nn.Linear", (16, 32), (("bias", True),)))
F_LINEAR = OpCase(op="linear", target="torch.nn.functional.linear",
                  inputs=INPUT + (InputDecl("other", (32, 16)), InputDecl("bias", (32,))))
SUM = OpCase(op="sum", target="torch.sum", inputs=INPUT, params=(("dim", (0, 2)), ("keepdim", False)),
             predecessor=ModuleDecl("torch.nn.Linear", (16, 32), (("bias", False),)))
TENSOR_SUM = OpCase(op="sum", target="torch.Tensor.sum", inputs=INPUT, params=(("dim", -1), ("keepdim", True)),
                    predecessor=ModuleDecl("torch.nn.Linear", (16, 32), (("bias", False),)))


@pytest.fixture(scope="module")
def mesh22():
    with SimulatedBackend(DeviceMesh((2, 2)), timeout=30) as backend:
        yield backend


@pytest.fixture(scope="module")
def mesh4():
    with SimulatedBackend(DeviceMesh((4,)), timeout=30) as backend:
        yield backend


def strategies(case, where):
    """The generated strategies of the case's op on a backend's mesh (or a mesh)."""
    mesh = where if isinstance(where, DeviceMesh) else where.mesh
    graph_module, node_name = case.build()
    return list(strategies_for_node(graph_module, node_name, mesh))


# ------------------------------------------------------------------------- tolerances

def test_default_tolerances_get_looser_with_lower_precision():
    rtols = [tolerance_for(d).rtol for d in ("float64", "float32", "float16", "bfloat16")]
    assert rtols == sorted(rtols)
    assert tolerance_for(torch.float32, rtol=0.5) == Tolerance(0.5, tolerance_for("float32").atol)


def test_tolerance_errors_name_the_bad_value():
    with pytest.raises(InvalidArgument, match="'float33' is not a torch dtype"):
        tolerance_for("float33")
    with pytest.raises(InvalidArgument, match="rtol must be a number >= 0, got -1"):
        Tolerance(-1, 0)


def test_compare_reports_errors_and_never_calls_nan_close():
    expected = torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64)
    found = compare(torch.tensor([1.0, 2.5, 0.0]), expected, Tolerance(0.1, 0.0))
    assert not found.close and found.max_abs_err == pytest.approx(0.5) and found.max_rel_err == pytest.approx(0.25)
    assert compare(torch.tensor([1.0, 2.1, 0.0]), expected, Tolerance(0.1, 0.0)).close
    assert not compare(torch.tensor([1.0, float("nan"), 0.0]), expected, Tolerance(1.0, 1.0)).close


# ---------------------------------------------------------------------------- OpCase

def test_case_validation_names_the_bad_value():
    with pytest.raises(InvalidArgument, match="'torch.nope' does not name"):
        OpCase(op="x", target="torch.nope", inputs=INPUT)
    with pytest.raises(InvalidArgument, match="needs module=ModuleDecl"):
        OpCase(op="linear", target="torch.nn.Linear", inputs=INPUT)
    with pytest.raises(InvalidArgument, match="input names repeat"):
        OpCase(op="sum", target="torch.sum", inputs=INPUT + INPUT)
    with pytest.raises(InvalidArgument, match="shape must be a tuple of positive ints"):
        InputDecl("x", (4, 0))
    with pytest.raises(InvalidArgument, match="not a torch.nn.Module class"):
        ModuleDecl("torch.sum")


def test_case_is_a_picklable_literal_and_builds_the_generic_harness():
    case = OpCase(op="sum", target="torch.sum", inputs=[InputDecl("x", [2, 4])], params={"dim": [0]})
    assert case.params == (("dim", (0,)),) and case.inputs[0].shape == (2, 4)
    assert eval(repr(case)) == case and pickle.loads(pickle.dumps(case)) == case
    graph_module, node_name = SUM.build()
    node = next(n for n in graph_module.graph.nodes if n.name == node_name)
    assert node.op == "call_function" and node.target is torch.sum and node.kwargs == {"dim": (0, 2), "keepdim": False}
    assert node.args[0].op == "call_module"  # the predecessor Linear
    assert tuple(node.meta["tensor_meta"].shape) == (4, 32)
    assert SUM.build() is SUM.build()  # built once per process
    assert SUM.describe() == ("sum(input: float32[4, 4, 4, 16], dim=(0, 2), keepdim=False) "
                              "after Linear(16, 32, bias=False)")


# ---------------------------------------------------------------------------- reports

def _failed_result() -> CheckResult:
    mismatch = Mismatch("values", 3, "grad of weight", actual_shape=(16, 16), expected_shape=(16, 16),
                        max_abs_err=1.5, max_rel_err=0.7, rtol=1.3e-6, atol=1e-5, dtype="float32")
    return CheckResult(op="linear", case="Linear(16, 32)", strategy="S0S1 = S0R x RS1_0", mesh_shape=(2, 2),
                       backend="simulated", dtype="float32", mismatches=(mismatch,))


def test_assert_passed_raises_a_readable_report():
    result = _failed_result()
    with pytest.raises(AssertionError) as info:
        assert_passed([result, result.__class__(**{**result.__dict__, "mismatches": ()})])
    text = str(info.value)
    assert text.splitlines()[0] == "1 of 2 strategy check(s) failed"
    for part in ("linear", "'S0S1 = S0R x RS1_0'", "mesh (2, 2)", "rank 3", "grad of weight", "(16, 16)",
                 "max abs error 1.5", "max rel error 0.7", "rtol=1.3e-06", "atol=1e-05"):
        assert part in text
    with pytest.raises(AssertionError, match="no strategy was verified"):
        assert_passed([])
    assert "__tracebackhide__" in assert_passed.__code__.co_varnames


# --------------------------------------------------------------------- verify_case

@pytest.mark.parametrize("case", [LINEAR, F_LINEAR, SUM, TENSOR_SUM], ids=["Linear", "F.linear", "sum", "Tensor.sum"])
def test_every_generated_strategy_passes(case, mesh22, mesh4):
    for backend in (mesh22, mesh4):
        results = verify_case(backend, case)
        assert_passed(results)
        assert [r.strategy for r in results] == [s.name for s in strategies(case, backend)]
        assert all(r.mesh_shape == backend.mesh.shape and r.backend == "simulated" for r in results)


def test_lower_precision_runs_with_its_own_tolerance(mesh4):
    results = verify_case(mesh4, LINEAR, dtype="bfloat16")
    assert_passed(results)
    assert {r.dtype for r in results} == {"bfloat16"}


def test_rounding_differences_are_rechecked_in_float64(mesh22):
    """With a zero tolerance float32 always differs from the float64 reference; the float64
    re-check shows it is rounding, so the strategy passes with a note."""
    strategy = next(s for s in strategies(LINEAR, mesh22) if s.communication_actions)
    result = verify_strategy(mesh22, LINEAR, strategy, tol=Tolerance(0.0, 0.0))
    assert result.passed, result.report()
    assert "single-device op's own float32 error" in result.note


def test_collectives_issued_must_match_the_declared_actions(mesh22, monkeypatch):
    """Hidden communication fails even when the numbers come out right: a gradient hook that
    all-reduces twice (then divides) gives correct gradients but issues an undeclared collective."""
    from shardverify.verify import rank

    strategy = next(s for s in strategies(LINEAR, mesh22)
                    if any(a.where is CommWhere.HOOK for a in s.communication_actions))
    honest = rank.grad_hook_on_ranks

    def chatty_hook(ranks, action, grads):
        twice = honest(ranks, action, honest(ranks, action, grads))
        return [g / ranks.mesh.axes_size(action.axes) for g in twice]

    monkeypatch.setattr(rank, "grad_hook_on_ranks", chatty_hook)
    result = verify_strategy(mesh22, LINEAR, strategy)
    assert not result.passed
    assert {m.kind for m in result.mismatches} == {"collectives"}
    assert result.failed_ranks == (0, 1, 2, 3)
    hook_axes = [a.axes for a in strategy.communication_actions if a.where is CommWhere.HOOK]
    axes = hook_axes[0]
    declared = expected_collectives(strategy, ["input_1", "weight", "bias"])[("all_reduce", axes)]
    assert (f"issued {declared + hook_axes.count(axes)} x all_reduce over axes {axes}" in result.report()), \
        result.report()


def test_expected_collectives_follow_the_patterns():
    strategy = next(s for s in strategies(LINEAR, DeviceMesh((2, 2)))
                    if s.name.startswith("S0S1 = S0R x RS1"))
    counts = expected_collectives(strategy, ["input_1", "weight", "bias", "linear"])
    assert counts == {("all_reduce", (1,)): 1, ("all_reduce", (0,)): 2}  # input grad; weight and bias hooks
    assert expected_collectives(strategy, []) == {}  # no gradient, no backward half


def test_declared_memory_cost_is_checked(mesh4):
    strategy = strategies(LINEAR, mesh4)[0]
    fwd, bwd, total = strategy.memory_cost
    wrong = MemoryCycle(MemoryCost(fwd.activation, fwd.parameter * 4), bwd, total)
    result = verify_strategy(mesh4, LINEAR, strategy.replace(memory_cost=wrong))
    assert [m.kind for m in result.mismatches] == ["memory"] * 4
    assert f"declared {fwd.activation} activation + {fwd.parameter * 4} parameter bytes" in result.report()


def test_a_rank_that_raises_fails_its_strategy_and_the_run_goes_on(mesh4):
    good = strategies(LINEAR, mesh4)
    layouts = dict(good[-1].sharding_specs)
    # Shard the input on its contracted dim while the weight stays whole: the local op cannot run.
    from shardverify.sharding.sharding_spec import ShardingSpec

    broken = good[-1].replace(name="broken", sharding_specs=tuple(
        (n, ShardingSpec.from_partition((4,), spec.tensor_shape, {3: (0,)}) if n == "input_1" else spec)
        for n, spec in layouts.items()))
    results = verify_case(mesh4, LINEAR, [broken, good[1]])
    assert not results[0].passed and results[1].passed
    assert {m.kind for m in results[0].mismatches} == {"error"}
    assert "broken" in results[0].report() and "raised" in results[0].report()


def test_backend_timeouts_become_failed_results_naming_the_ranks():
    class HangingBackend:
        mesh = DeviceMesh((4,))

        def run(self, fn, *args, timeout=None):
            raise RankTimeout((1, 2), timeout or 5.0, "rank_check")

    strategy = strategies(LINEAR, DeviceMesh((4,)))[0]
    result = verify_strategy(HangingBackend(), LINEAR, strategy, timeout=5.0)
    assert not result.passed and result.failed_ranks == (1, 2)
    assert "did not finish within 5s" in result.report() and strategy.name in result.report()


def test_inconsistent_actions_are_reported_without_running(mesh4):
    strategy = strategies(LINEAR, mesh4)[0]
    misplaced = CommAction(CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, (0,), "input_1", CommWhere.AFTER)
    result = verify_strategy(mesh4, LINEAR, strategy.replace(communication_actions=(misplaced,)))
    assert [m.kind for m in result.mismatches] == ["error"]
    assert "AFTER applies to the output" in result.report()


def test_a_strategy_for_another_mesh_is_refused(mesh4, mesh22):
    with pytest.raises(InvalidArgument, match=r"is for mesh \(2, 2\), the backend's mesh is \(4,\)"):
        verify_strategy(mesh4, LINEAR, strategies(LINEAR, mesh22)[0])


def test_format_results_counts_failures():
    assert format_results([_failed_result()]).startswith("1 of 1 strategy check(s) failed")
    assert engine.rank_check.__module__ == "shardverify.verify.together"  # importable by process workers


def _hand_made(mesh: DeviceMesh, name: str, layouts: dict, actions: tuple) -> ShardingStrategy:
    """A linear strategy written by hand from the first generated one (operands and costs
    recomputed), to exercise the patterns the generators do not use yet."""
    from shardverify.strategies.generators.common import with_declared_costs
    from shardverify.sharding.sharding_spec import ShardingSpec

    base = strategies(LINEAR, mesh)[0]
    specs = {n: ShardingSpec.from_partition(mesh.shape, s.tensor_shape, layouts.get(n, {}))
             for n, s in base.sharding_specs}
    return with_declared_costs(base.replace(name=name, sharding_specs=tuple(specs.items()),
                                            communication_actions=actions, post_add=()), *LINEAR.build(), mesh)


def _action(pattern, operand, where, dims=()):
    return CommAction(pattern, (0,), operand, where, dims)


@pytest.mark.parametrize("layouts, actions, name", [
    ({"input_1": {0: (0,)}}, (_action(CommPattern.GATHER_FWD_SPLIT_BWD, "input_1", CommWhere.BEFORE, (0,)),),
     "gather the batch-sharded input"),
    ({"linear": {0: (0,)}}, (_action(CommPattern.SPLIT_FWD_GATHER_BWD, "linear", CommWhere.AFTER, (0,)),),
     "split the output"),
    ({"input_1": {0: (0,)}, "linear": {1: (0,)}},
     (_action(CommPattern.ALL2ALL_FWD_ALL2ALL_BWD, "input_1", CommWhere.BEFORE, (1, 0)),
      _action(CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, "weight", CommWhere.HOOK),
      _action(CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, "bias", CommWhere.HOOK)),
     "all-to-all the input from dim 0 to dim 1"),
])
def test_every_pattern_executes_as_declared(mesh4, layouts, actions, name):
    good = _hand_made(mesh4.mesh, name, layouts, actions)
    assert_passed(verify_strategy(mesh4, LINEAR, good))
    # The same action on the wrong tensor dim moves the wrong data: caught.
    wrong_dims = tuple(dataclasses.replace(a, dims=tuple(d + 1 for d in a.dims)) if a.dims else a for a in actions)
    result = verify_strategy(mesh4, LINEAR, good.replace(name=f"{name} (wrong dim)", communication_actions=wrong_dims))
    assert not result.passed and f"{name} (wrong dim)" in result.report()
    # Without the action the local op sees the wrong layout: caught.
    result = verify_strategy(mesh4, LINEAR, good.replace(name=f"{name} (dropped)", communication_actions=actions[1:]))
    assert not result.passed
