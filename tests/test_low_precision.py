"""Low-precision checks hold a strategy to the single-device op's own error in that dtype.

A strategy may lose a little more than one device does (its partial results are rounded
once more before they are reduced), but not BUDGET_FACTOR times more; the float64 re-check
only says whether the maths is wrong or the rounding is."""

from __future__ import annotations

import pytest
import torch

from shardverify import DeviceMesh
from shardverify.strategies.for_node import strategies_for_node
from shardverify.backends import SimulatedBackend
from shardverify.collectives import patterns
from shardverify.verify import rank
from shardverify.sharding.strategy import CommPattern, CommWhere
from shardverify.spec.case import InputDecl, ModuleDecl, OpCase
from shardverify.verify.engine import verify_strategy
from shardverify.verify.local_errors import rank_local_errors
from shardverify.verify.precision import BUDGET_FACTOR, error_budgets, single_device_errors

LINEAR = OpCase(op="linear", target="torch.nn.Linear", inputs=(InputDecl("input", (4, 4, 64)),),
                module=ModuleDecl("torch.nn.Linear", (64, 32), (("bias", False),)))


@pytest.fixture(scope="module")
def mesh4():
    with SimulatedBackend(DeviceMesh((4,)), timeout=30) as backend:
        yield backend


def partial_output_strategy(backend):
    """A generated linear strategy whose output is a partial sum all-reduced after the op."""
    graph_module, node_name = LINEAR.build()
    return next(s for s in strategies_for_node(graph_module, node_name, backend.mesh)
                if any(a.pattern is CommPattern.ALLREDUCE_FWD_IDENTITY_BWD and a.where is CommWhere.AFTER
                       for a in s.communication_actions))


def plant_all_reduce(monkeypatch, forward_half) -> None:
    """The planted bug: ALLREDUCE_FWD_IDENTITY_BWD's forward half replaced by ``forward_half``
    (ranks, action, tensors) -> tensors."""
    halves = dict(patterns._HALVES)
    halves[CommPattern.ALLREDUCE_FWD_IDENTITY_BWD] = (forward_half, patterns._identity)
    monkeypatch.setattr(patterns, "_HALVES", halves)


def reduced_through(checked: torch.dtype, low: torch.dtype):
    """An all-reduce that, in a check run in ``checked``, rounds each partial to ``low``, sums
    them exactly (float32) and rounds the total to ``low`` too; in any other dtype, exact."""
    def sloppy(ranks, action, ts):
        if ts[0].dtype is not checked:
            return ranks.all_reduce([t.contiguous() for t in ts], action.axes, "sum")
        lowered = [t.to(low).to(torch.float32).contiguous() for t in ts]
        return [total.to(low).to(checked) for total in ranks.all_reduce(lowered, action.axes, "sum")]

    return sloppy


@pytest.fixture
def partials_reduced_in_a_lower_dtype(monkeypatch):
    """The planted bug: the partial outputs of a float16 run are summed in float8 (e5m2) and
    cast back; float32 and float64 runs are untouched, so the maths is exact there."""
    plant_all_reduce(monkeypatch, reduced_through(torch.float16, torch.float8_e5m2))


def test_the_single_device_error_is_measured_in_the_dtype():
    outputs16, grads16 = single_device_errors(LINEAR, torch.float16)
    outputs64, grads64 = single_device_errors(LINEAR, torch.float64)
    assert outputs16[0] > 0 and all(e > 0 for e in grads16.values())
    assert outputs64[0] < outputs16[0] * 1e-6
    assert set(grads16) == {("arg", 0), ("param", "weight")}


def test_a_budget_in_the_cases_own_dtype_reads_the_checks_reference_and_another_builds_its_own():
    """A float32 case's float32 budget holds every value as the check does: one reference serves
    both; a float16 budget changes the values, so it has a reference of its own."""
    from shardverify.verify.reference import reference

    cpu = torch.device("cpu")
    assert reference(LINEAR, torch.float32, cpu) is reference(LINEAR, None, cpu)
    assert reference(LINEAR, torch.float16, cpu) is not reference(LINEAR, None, cpu)
    assert reference(LINEAR, torch.float16, cpu).values[("arg", 0)].dtype == torch.float64
    assert not torch.equal(reference(LINEAR, torch.float16, cpu).values[("arg", 0)],
                           reference(LINEAR, None, cpu).values[("arg", 0)])   # rounded through float16


def test_correct_strategy_passes_in_float16_within_the_budget(mesh4):
    strategy = partial_output_strategy(mesh4)
    result = verify_strategy(mesh4, LINEAR, strategy, dtype="float16")
    assert result.passed, result.report()
    budgets = error_budgets(LINEAR, strategy, torch.float16)
    assert set(budgets) >= {"output", f"grad of {strategy.inputs[0].name}"}


def test_strategy_exact_in_float64_but_sloppy_in_float16_fails(mesh4, partials_reduced_in_a_lower_dtype):
    strategy = partial_output_strategy(mesh4)
    assert verify_strategy(mesh4, LINEAR, strategy, dtype="float64").passed
    assert verify_strategy(mesh4, LINEAR, strategy, dtype="float32").passed
    result = verify_strategy(mesh4, LINEAR, strategy, dtype="float16")
    assert not result.passed
    assert result.note.startswith("too much rounding"), result.note
    assert {m.tensor for m in result.mismatches} == {"output"}
    assert f"exceeds {BUDGET_FACTOR:g} x" in result.report()


def test_wrong_maths_in_float16_is_labelled_by_the_float64_recheck(mesh4, monkeypatch):
    """A reduction that is off by 2% in every dtype fails, and the re-check calls it maths."""
    def off(ranks, action, ts):
        return [total * 1.02 for total in ranks.all_reduce([t.contiguous() for t in ts], action.axes, "sum")]

    plant_all_reduce(monkeypatch, off)
    result = verify_strategy(mesh4, LINEAR, partial_output_strategy(mesh4), dtype="float16")
    assert not result.passed
    assert result.note.startswith("wrong maths: the float64 re-check fails too"), result.note


# ---- a long reduction: the budget at the shapes each rank computes --------------------------

#: 32768 rows summed into the weight's gradient. MKL sums (32768 x 32)^T x (32768 x 16) in blocks,
#: its 32768 x 8 half (a rank's, input and weight split on in_features) as one running sum: 13x
#: the single-device error, as correct (the strategy is exact in float64).
LONG = OpCase(op="linear", target="torch.nn.Linear", inputs=(InputDecl("input", (32768, 16)),),
              module=ModuleDecl("torch.nn.Linear", (16, 32), (("bias", False),)))


@pytest.fixture(scope="module")
def mesh2():
    with SimulatedBackend(DeviceMesh((2,)), timeout=60) as backend:
        yield backend


def long_strategy(mesh: DeviceMesh, name: str):
    graph_module, node_name = LONG.build()
    return next(s for s in strategies_for_node(graph_module, node_name, mesh) if s.name == name)


def split_on_in_features(backend):
    """Input and weight split on in_features, the partial outputs all-reduced."""
    return long_strategy(backend.mesh, "RR = RS0 x S0R")


def test_the_rank_shape_error_is_the_narrow_products_own():
    """A rank's measured error is the float32 error of its own product, measured here directly."""
    from shardverify.verify.reference import reference

    strategy = long_strategy(DeviceMesh((2,)), "RR = RS0 x S0R")
    ref = reference(LONG, torch.float32, torch.device("cpu"))
    x, g = ref.values[("arg", 0)].reshape(-1, 16), ref.grad_outputs[0].reshape(-1, 32)
    narrow = max(float((g.float().T @ x[:, half].float() - g.T @ x[:, half]).abs().max())
                 for half in (slice(0, 8), slice(8, 16)))
    assert (rank_local_errors(LONG, strategy, torch.float32) or {}).get("grad of weight") == pytest.approx(narrow, rel=1e-12)


def test_a_correct_long_reduction_is_judged_at_the_ranks_shapes(mesh2):
    """Refused by the single-device budget alone (the rank's product is 13x less lucky, not
    wrong); within the budget at the ranks' shapes."""
    strategy = split_on_in_features(mesh2)
    single = error_budgets(LONG, strategy, torch.float32)["grad of weight"]
    at_ranks = error_budgets(LONG, strategy, torch.float32, at_rank_shapes=True)["grad of weight"]
    if not at_ranks > BUDGET_FACTOR * single:   # MKL (CI's torch) sums the rank's narrow product sequentially
        pytest.skip("this BLAS sums a rank's narrow product about as accurately as the full one: the single-device "
                    "budget alone does not refuse the strategy, so there is nothing to tell apart")
    result = verify_strategy(mesh2, LONG, strategy)
    assert result.passed, result.report()
    assert result.note.startswith("exact in float64, and the float32 differences are within"), result.note
    assert "at the full shapes or a rank's" in result.note, result.note


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_partials_reduced_in_a_lower_dtype_still_fail_at_the_ranks_shapes(mesh2, monkeypatch, low):
    """The same strategy summing its partial outputs in float16 or bfloat16: over the budget at
    the ranks' shapes too (the ranks' op is measured on its own, never the strategy's reduction)."""
    plant_all_reduce(monkeypatch, reduced_through(torch.float32, low))   # float64 untouched: the maths stays exact
    strategy = split_on_in_features(mesh2)
    assert verify_strategy(mesh2, LONG, strategy, dtype="float64").passed
    result = verify_strategy(mesh2, LONG, strategy)
    assert not result.passed
    assert result.note.startswith("too much rounding"), result.note
    assert {m.tensor for m in result.mismatches} == {"output"}
    assert "at the full shapes or a rank's" in result.report()


def test_wrong_maths_within_the_budget_at_the_ranks_shapes_is_still_rechecked(monkeypatch):
    """A weight gradient off after its all-reduce (in every dtype) by an error over the single-device
    budget but within the one at the ranks' shapes (a rank's 16384 x 8 product summed as one
    running sum): a pass there needs the float64 re-check, which fails."""
    honest, planted = rank.grad_hook_on_ranks, []
    monkeypatch.setattr(rank, "grad_hook_on_ranks",
                        lambda ranks, action, gs: [g + planted[0] for g in honest(ranks, action, gs)])
    with SimulatedBackend(DeviceMesh((2, 2)), timeout=60) as backend:
        strategy = long_strategy(backend.mesh, "S0R = S0S1 x S1R_0")
        at_ranks = BUDGET_FACTOR * error_budgets(LONG, strategy, torch.float32, at_rank_shapes=True)["grad of weight"]
        single = BUDGET_FACTOR * error_budgets(LONG, strategy, torch.float32)["grad of weight"]
        if not 2 * single < at_ranks:   # the planted error must fit between the two budgets to test the re-check
            pytest.skip(f"this BLAS sums a rank's narrow product about as accurately as the full one (the budget at "
                        f"the ranks' shapes is {at_ranks:.3g}): no wrong gradient hides within it")
        planted.append((single + at_ranks) / 2)
        result = verify_strategy(backend, LONG, strategy)
    assert not result.passed
    assert result.note.startswith("wrong maths: the float64 re-check fails too"), result.note


# ---- what the op sees after its BEFORE actions: the same yardstick ------------------------

def split_before_the_op(mesh: DeviceMesh):
    """``RR = RS0 x S0R`` with its input held whole and split on in_features before the op: each
    rank's op sees exactly the narrow block the plain strategy's does (a hand-made strategy, as a
    user's may be: no generator makes one today)."""
    from shardverify.sharding.strategy import CommAction
    from shardverify.strategies.generators.common import with_declared_costs

    graph_module, node_name = LONG.build()
    base = long_strategy(mesh, "RR = RS0 x S0R")
    whole = dict(long_strategy(mesh, "RR = RR x RR").sharding_specs)["input_1"]
    split = CommAction(CommPattern.SPLIT_FWD_GATHER_BWD, (0,), "input_1", CommWhere.BEFORE, dims=(1,))
    hand = base.replace(name="RR = RR>RS0 x S0R", sharding_specs=tuple(
        (name, whole if name == "input_1" else spec) for name, spec in base.sharding_specs),
        communication_actions=(split, *base.communication_actions))
    return with_declared_costs(hand, graph_module, node_name, mesh)


def test_the_rank_shape_error_is_measured_on_what_the_op_sees_after_its_before_actions():
    mesh = DeviceMesh((2,))
    seen = rank_local_errors(LONG, split_before_the_op(mesh), torch.float32)
    assert seen is not None and seen == rank_local_errors(LONG, long_strategy(mesh, "RR = RS0 x S0R"), torch.float32)


def test_a_correct_long_reduction_split_before_the_op_is_judged_at_the_ranks_shapes(mesh2):
    """Refused as 'too much rounding' while the budget at the ranks' shapes measured only
    strategies whose ops see their layouts' blocks."""
    strategy, plain = split_before_the_op(mesh2.mesh), split_on_in_features(mesh2)   # the same view of the op
    if not error_budgets(LONG, plain, torch.float32, at_rank_shapes=True)["grad of weight"] > \
            BUDGET_FACTOR * error_budgets(LONG, plain, torch.float32)["grad of weight"]:
        pytest.skip("this BLAS sums a rank's narrow product about as accurately as the full one")
    result = verify_strategy(mesh2, LONG, strategy)
    assert result.passed, result.report()
    assert "at the full shapes or a rank's" in result.note, result.note


def test_an_input_rounded_to_bfloat16_by_its_split_before_the_op_still_fails(mesh2, monkeypatch):
    """The op's error is measured on the numbers it sees, widened: what the BEFORE step itself
    loses is the strategy's, and over the budget."""
    halves = dict(patterns._HALVES)
    exact_split, gather = halves[CommPattern.SPLIT_FWD_GATHER_BWD]
    halves[CommPattern.SPLIT_FWD_GATHER_BWD] = (
        lambda ranks, action, ts: [t.to(torch.bfloat16).to(t.dtype) if t.dtype is torch.float32 else t
                                   for t in exact_split(ranks, action, ts)], gather)
    monkeypatch.setattr(patterns, "_HALVES", halves)
    strategy = split_before_the_op(mesh2.mesh)
    assert verify_strategy(mesh2, LONG, strategy, dtype="float64").passed
    result = verify_strategy(mesh2, LONG, strategy)
    assert not result.passed
    assert result.note.startswith("too much rounding"), result.note
    assert "at the full shapes or a rank's" in result.report()


def test_partials_reduced_in_bfloat16_after_a_split_before_the_op_still_fail(mesh2, monkeypatch):
    plant_all_reduce(monkeypatch, reduced_through(torch.float32, torch.bfloat16))
    strategy = split_before_the_op(mesh2.mesh)
    result = verify_strategy(mesh2, LONG, strategy)
    assert not result.passed
    assert result.note.startswith("too much rounding"), result.note
    assert {m.tensor for m in result.mismatches} == {"output"}


def test_an_index_shard_is_measured_on_the_ids_shifted_into_it():
    """Vocab-parallel embedding: each rank's op sees its ids shifted into its rows of the table."""
    case = OpCase(op="embedding", target="torch.nn.functional.embedding",
                  inputs=(InputDecl("input", (64, 8), dtype="int64", values=(0, 16)), InputDecl("weight", (16, 16))))
    graph_module, node_name = case.build()
    strategy = next(s for s in strategies_for_node(graph_module, node_name, DeviceMesh((2,))) if s.index_shards)
    errors = rank_local_errors(case, strategy, torch.bfloat16)
    assert errors is not None and errors["grad of weight"] > 0


# ---- a few elements: what rounding them may lose, not one lucky draw ------------------------

#: a sum to one number: the single-device bfloat16 error is one rounding, which may fall near 0
TOTAL = OpCase(op="sum", target="torch.sum", inputs=(InputDecl("input", (4, 4, 4, 16)),),
               params=(("dim", None), ("keepdim", False)),
               predecessor=ModuleDecl("torch.nn.Linear", (16, 32), (("bias", False),)))


@pytest.fixture(scope="module")
def mesh22():
    with SimulatedBackend(DeviceMesh((2, 2)), timeout=60) as backend:
        yield backend


def partial_total(backend):
    """Each rank sums its dim-1 block of a piece of the input (a partial sum over mesh axis 1):
    four bfloat16 partials, all-reduced; refused by one lucky draw of the single-device rounding
    (15 of this case's 108 strategies were, in bfloat16), and by the op's own rounding at the
    ranks' shapes alone too (its error 0.247, one draw there 0.0258)."""
    graph_module, node_name = TOTAL.build()
    return next(s for s in strategies_for_node(graph_module, node_name, backend.mesh)
                if s.name == "[R, S0, R, R]+P1 -> [] | P01 sum_7")


def test_a_scalar_result_is_held_to_its_rounding_not_one_lucky_draw(mesh22):
    """Its budget is at least the unit roundoff times its value (one rounding into bfloat16)."""
    (error,), _ = single_device_errors(TOTAL, torch.bfloat16)
    from shardverify.verify.reference import reference

    value = float(reference(TOTAL, torch.bfloat16, torch.device("cpu")).outputs[0].abs())
    assert error >= torch.finfo(torch.bfloat16).eps / 2 * value > 0
    result = verify_strategy(mesh22, TOTAL, partial_total(mesh22), dtype="bfloat16")
    assert result.passed, result.report()


def test_a_scalar_reduced_through_float8_still_fails(mesh22, monkeypatch):
    plant_all_reduce(monkeypatch, reduced_through(torch.bfloat16, torch.float8_e5m2))   # other dtypes exact
    result = verify_strategy(mesh22, TOTAL, partial_total(mesh22), dtype="bfloat16")
    assert not result.passed
    assert result.note.startswith("too much rounding"), result.note
