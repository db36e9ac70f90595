"""Non-finite values compare exactly: inf with inf of the same sign, NaN with NaN, at the
same positions; anything else fails and names the first bad index."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from shardverify import DeviceMesh
from shardverify.strategies.for_node import strategies_for_node
from shardverify.backends import SimulatedBackend
from shardverify.collectives import patterns
from shardverify.strategies.generators.common import with_declared_costs
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.sharding.strategy import CommAction, CommPattern, CommWhere
from shardverify.spec.case import InputDecl, ModuleDecl, OpCase
from shardverify.verify.engine import verify_case, verify_strategy
from shardverify.verify.report import assert_passed
from shardverify.verify.tolerance import Tolerance, compare

INF, NAN = math.inf, math.nan
TOL = Tolerance(1e-3, 1e-5)


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("actual, expected", [
    (t(1.0), t(INF)), (t(INF), t(1.0)), (t(INF), t(-INF)), (t(-INF), t(INF)),
    (t(NAN), t(1.0)), (t(1.0), t(NAN)), (t(NAN), t(INF)), (t(INF), t(NAN)), (t(-INF), t(NAN)),
])
def test_non_finite_disagreements_fail(actual, expected):
    found = compare(actual, expected, TOL)
    assert not found.close
    assert "first at index [0]" in found.nonfinite


@pytest.mark.parametrize("values", [t(INF), t(-INF), t(NAN), t(1.0, INF, -INF, NAN, 2.0)])
def test_same_non_finite_values_at_the_same_positions_pass(values):
    found = compare(values.clone(), values, TOL)
    assert found.close and found.nonfinite == "" and found.max_abs_err == 0.0


def test_finite_positions_are_still_held_to_the_tolerance():
    assert not compare(t(INF, 1.0), t(INF, 1.1), TOL).close
    assert compare(t(INF, 1.0), t(INF, 1.0 + 1e-6), TOL).close


def test_the_first_bad_index_is_named_in_several_dimensions():
    expected = torch.zeros(2, 3, dtype=torch.float64)
    expected[1, 2] = INF
    actual = expected.clone()
    actual[0, 1] = NAN
    actual[1, 2] = -INF
    found = compare(actual, expected, TOL)
    assert not found.close
    assert found.nonfinite.startswith("2 non-finite mismatch(es), first at index [0, 1]: got nan, expected 0.0")


def test_low_precision_infinities_compare_after_the_cast():
    assert compare(torch.tensor([INF], dtype=torch.float16), t(INF), TOL).close
    assert not compare(torch.tensor([65504.0], dtype=torch.float16), t(INF), TOL).close


# ------------------------------------------------------------------ through the engine

# Entries below -1.5 become -inf before the sum: the reference output mixes finite sums and -inf.
NEG_INF_SUM = OpCase(op="sum", target="torch.sum", inputs=(InputDecl("input", (4, 8)),),
                     params=(("dim", 0), ("keepdim", False)),
                     predecessor=ModuleDecl("torch.nn.Threshold", (), (("threshold", -1.5), ("value", -INF))))
# Entries below -1.5 become NaN: a legitimately NaN reference.
NAN_SUM = OpCase(op="sum", target="torch.sum", inputs=(InputDecl("input", (4, 8)),),
                 params=(("dim", 1), ("keepdim", True)),
                 predecessor=ModuleDecl("torch.nn.Threshold", (), (("threshold", -1.5), ("value", NAN))))


@pytest.fixture(scope="module")
def mesh2():
    with SimulatedBackend(DeviceMesh((2,)), timeout=30) as backend:
        yield backend


def generated(case, backend):
    """The sum's generated strategies. A Threshold predecessor has no handler, so they are
    generated for the same case with a shape-preserving Linear predecessor: operands are
    found by their place in the call, so the strategies fit the Threshold case as well."""
    twin = dataclasses.replace(case, predecessor=ModuleDecl("torch.nn.Linear", (8, 8)))
    graph_module, node_name = twin.build()
    return list(strategies_for_node(graph_module, node_name, backend.mesh))


def partial_sum(case, backend, op="sum"):
    """The sum over dim 0 kept sharded over the mesh, partial sums all-reduced with ``op``."""
    base = generated(case, backend)[0]
    (in_name, in_spec), (out_name, out_spec) = base.sharding_specs
    mesh = backend.mesh.shape
    specs = {in_name: ShardingSpec.from_partition(mesh, in_spec.tensor_shape, {0: (0,)}),
             out_name: ShardingSpec.from_partition(mesh, out_spec.tensor_shape, {})}
    return with_declared_costs(base.replace(
        name=f"partial sum reduced with {op}", sharding_specs=tuple(specs.items()),
        communication_actions=(CommAction(CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, (0,), out_name,
                                          CommWhere.AFTER, op=op),)), *case.build(), backend.mesh)


def reference_output(case):
    from shardverify.verify.reference import reference
    return reference(case, None, torch.device("cpu")).output


def test_the_cases_really_have_non_finite_references():
    out = reference_output(NEG_INF_SUM)
    assert out.isneginf().any() and torch.isfinite(out).any()
    assert reference_output(NAN_SUM).isnan().any()


def test_correct_strategies_pass_when_the_reference_has_inf_and_nan(mesh2):
    assert_passed(verify_case(mesh2, NEG_INF_SUM, generated(NEG_INF_SUM, mesh2)))
    assert_passed(verify_case(mesh2, NAN_SUM, generated(NAN_SUM, mesh2)))
    assert verify_strategy(mesh2, NEG_INF_SUM, partial_sum(NEG_INF_SUM, mesh2)).passed


def test_an_all_reduce_that_saturates_infinities_is_caught(mesh2, monkeypatch):
    """A reduction that clamps -inf to the dtype's lowest finite value leaves every finite
    position exact; the old rule (bound = atol + rtol * |inf|) called that close."""
    def saturating(ranks, action, ts):
        return [torch.nan_to_num(total) for total in ranks.all_reduce([t.contiguous() for t in ts], action.axes, "sum")]

    halves = dict(patterns._HALVES)
    halves[CommPattern.ALLREDUCE_FWD_IDENTITY_BWD] = (saturating, patterns._identity)
    monkeypatch.setattr(patterns, "_HALVES", halves)
    result = verify_strategy(mesh2, NEG_INF_SUM, partial_sum(NEG_INF_SUM, mesh2))
    assert not result.passed
    out = reference_output(NEG_INF_SUM)
    first = int(out.isneginf().nonzero()[0])
    assert f"first at index [{first}]: got {torch.finfo(torch.float32).min!r}, expected -inf" in result.report()
    assert {m.rank for m in result.mismatches} == {0, 1}


def test_a_wrong_strategy_on_an_inf_reference_is_caught_naming_the_index(mesh2):
    """Partial sums reduced with max instead of sum: where one rank's partial is -inf and the
    other's finite, max gives a finite number against a -inf reference."""
    result = verify_strategy(mesh2, NEG_INF_SUM, partial_sum(NEG_INF_SUM, mesh2, op="max"))
    assert not result.passed
    assert "non-finite mismatch(es), first at index" in result.report()
