"""The audit and ``verify`` apply one rule to non-finite values: finite values within
tolerance, NaN only against NaN and inf only against inf of the same sign, at the same place.

``x ** y`` with a tensor exponent (aten.pow.Tensor_Tensor) on normal data has NaN wherever a
negative base meets a fractional exponent, in the output and in both gradients. Every strategy
of it is correct (verify passes them all); the audit once called all of them, replicated
included, incorrect, because its closeness check failed on any NaN. A strategy that pairs the
wrong shards (NaN in other places) must still be flagged by both."""

from __future__ import annotations

import torch
import pytest

from shardverify.features.audit.decide import Problem
from shardverify.sharding.layout import Layout
from shardverify.features.audit.combinations import CaseCombinations
from shardverify.features.audit.run import audit_spec, offered_strategies
from shardverify.backends import get_backend
from shardverify.spec.catalogue import load_op_specs
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.strategies.generators.registry import GeneratorContext, get_generator, register_generator
from shardverify.strategies.rules.sources import parse_rule
from shardverify.verify.engine import verify_case
from shardverify.verify.reference import reference
from shardverify.verify.report import CheckResult
from shardverify.verify.tolerance import Tolerance, compare, is_close

POW_TT = """\
op: {op}
description: test-only; aten.pow.Tensor_Tensor, x ** y elementwise with a tensor exponent.
targets: [torch.ops.aten.pow.Tensor_Tensor]
operands:
  input: {{kind: input, index: 0, keyword: self}}
  exponent: {{kind: input, index: 1, keyword: exponent}}
  output: {{kind: output}}
generator:
  family: {family}
  options:
    pointwise: true
verify:
  inputs:                        # normal data: negative bases, fractional exponents -> NaN
    input: {{shape: [8, 4, 6]}}
    exponent: {{shape: [8, 4, 6]}}
  meshes: {meshes}
"""

SWAPPED = " (exponent on the other axis)"


@register_generator("audit_test_swaps_the_exponent_axis", parse=parse_rule)   # the rules options
def _swaps_the_exponent_axis(ctx: GeneratorContext) -> list:
    """The pointwise rule, plus, for each strategy sharding the exponent's dim 0 over one axis
    of a 2-D mesh, a wrong copy sharding it over the other axis: the local shapes still fit,
    but each rank pairs its bases with another rank's exponents."""
    strategies = get_generator("rules")(ctx)
    exponent = ctx.operand("exponent").name
    wrong = []
    for strategy in strategies:
        specs = dict(strategy.sharding_specs)
        spec = specs[exponent]
        if len(spec.mesh_shape) != 2 or list(spec.partition_dict()) != [0] or len(spec.partition_dict()[0]) != 1:
            continue
        other = ShardingSpec(spec.mesh_shape, spec.tensor_shape, ((0, (1 - spec.partition_dict()[0][0],)),))
        wrong.append(strategy.replace(name=strategy.name + SWAPPED, sharding_specs=tuple(
            (name, other if name == exponent else s) for name, s in strategy.sharding_specs)))
    return strategies + wrong


def _spec(tmp_path, op: str, family: str, meshes: str):
    folder = tmp_path / "specs"
    folder.mkdir(exist_ok=True)
    (folder / f"{op}.yaml").write_text(POW_TT.format(op=op, family=family, meshes=meshes))
    return load_op_specs(tmp_path, folder, [str(folder / f"{op}.yaml")])[0]


def _verify(spec) -> dict[str, CheckResult]:
    """"[mesh] strategy" -> verify's result, for every case and mesh, with the strategies the
    spec offers (the verifier's own path, without registering a handler)."""
    found = {}
    for _, case in spec.op_cases():
        for mesh_shape in spec.verify.meshes:
            mesh = DeviceMesh(tuple(mesh_shape))
            graph_module, node_name = case.build()
            node = next(n for n in graph_module.graph.nodes if n.name == node_name)
            _, strategies = offered_strategies(spec, graph_module, node, mesh)
            backend = get_backend("simulated", mesh)
            try:
                for result in verify_case(backend, case, strategies):
                    found[f"{list(mesh_shape)} {result.strategy}"] = result
            finally:
                backend.close()
    return found


def test_the_reference_has_nan_in_the_output_and_both_gradients(tmp_path):
    spec = _spec(tmp_path, "pow_tt", "rules", "[[4]]")
    ref = reference(spec.op_cases()[0][1], torch.float64, torch.device("cpu"))
    assert all(0 < int(t.isnan().sum()) < t.numel() for t in (*ref.outputs, *ref.grads.values()))
    assert len(ref.grads) == 2


def test_audit_and_verify_agree_every_pow_tensor_strategy_is_correct(tmp_path):
    spec = _spec(tmp_path, "pow_tt", "rules", "[[4], [2, 2]]")
    checked = _verify(spec)
    assert checked and all(r.passed for r in checked.values()), [r.headline for r in checked.values()]
    assert any(name.endswith("RRR x RRR -> RRR") for name in checked)
    for result in audit_spec(spec):
        assert not result.error
        assert result.incorrect == [], [f.line for f in result.incorrect]
        assert result.missing == [], [f.line for f in result.missing]
        assert result.offered > 0 and result.covered + len(result.accepted) == result.valid   # accepted: S10


def test_a_strategy_pairing_the_wrong_shards_is_flagged_by_both(tmp_path):
    spec = _spec(tmp_path, "pow_tt_swapped", "audit_test_swaps_the_exponent_axis", "[[2, 2]]")
    checked = _verify(spec)
    wrong = {name for name in checked if name.endswith(SWAPPED)}
    assert len(wrong) == 2   # S0RR and S1RR, their exponent on the other axis
    assert all({m.kind for m in checked[name].mismatches} == {"values"} for name in wrong)
    assert all(r.passed for name, r in checked.items() if name not in wrong)
    [result] = audit_spec(spec)
    flagged = {f.strategy for f in result.incorrect}
    assert {f"[2, 2] {name}" for name in flagged} == wrong
    assert all("not valid without communication" in f.line for f in result.incorrect)


def _pow_problem(tmp_path) -> Problem:
    spec = _spec(tmp_path, "pow_tt", "rules", "[[2, 2]]")
    _, case = spec.op_cases()[0]
    return CaseCombinations(spec, case, (2, 2), partial_inputs=False).problem


def test_local_outputs_with_nan_elsewhere_form_no_layout(tmp_path):
    problem = _pow_problem(tmp_path)
    rows = Layout(((0,), (), ()))
    assert problem.decide((rows, rows)).outputs == (rows,)
    # same local shapes, shards of different rows: every rank's NaN falls elsewhere
    outcome = problem.decide((rows, Layout(((1,), (), ()))))
    assert not outcome.valid and "matches no" in outcome.reason
    # the right local outputs, with one NaN moved: a NaN against a number, a number against a NaN
    ref = problem.outputs[0]
    outs = [t[0] for t in problem.run((rows, rows))]
    assert problem.holds(outs, rows, 0, ref)
    local = outs[0]
    nan_at = int(local.isnan().flatten().nonzero()[0])
    num_at = int((~local.isnan()).flatten().nonzero()[0])
    moved = local.clone().flatten()
    moved[nan_at], moved[num_at] = moved[num_at], float("nan")
    assert not problem.holds([moved.reshape(local.shape), *outs[1:]], rows, 0, ref)


@pytest.mark.parametrize("seed", range(20))
def test_is_close_is_compares_verdict(seed):
    gen = torch.Generator().manual_seed(seed)
    tol = Tolerance(1e-6, 1e-6)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0], dtype=torch.float64)
    expected = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    at = torch.rand(5, 7, generator=gen) < 0.3
    expected[at] = specials[torch.randint(0, 4, (int(at.sum()),), generator=gen)]
    for change in range(4):
        actual = expected.clone()
        spots = torch.rand(5, 7, generator=gen) < 0.1
        if change == 1:
            actual[spots] = specials[torch.randint(0, 4, (int(spots.sum()),), generator=gen)]
        elif change == 2:
            actual = actual + 1e-3 * spots
        elif change == 3:
            actual = actual.to(torch.float32)
        for finite in (None, bool(torch.isfinite(expected).all())):
            assert is_close(actual, expected, tol, finite=finite) == compare(actual, expected, tol).close


def test_is_close_on_nan_and_inf():
    tol = Tolerance(1e-9, 1e-9)
    nan, inf = float("nan"), float("inf")
    f64 = torch.float64
    ref = torch.tensor([1.0, nan, inf, -inf], dtype=f64)
    assert is_close(ref.clone(), ref, tol)
    assert not is_close(torch.tensor([nan, 1.0, inf, -inf], dtype=f64), ref, tol)     # NaN moved
    assert not is_close(torch.tensor([1.0, nan, -inf, -inf], dtype=f64), ref, tol)    # inf of the other sign
    assert not is_close(torch.tensor([1.0, nan, 1e300, -inf], dtype=f64), ref, tol)   # a number for an inf
    assert not is_close(torch.tensor([inf, 1.0], dtype=f64), torch.tensor([1.0, 1.0], dtype=f64),
                        Tolerance(1.0, inf))                                          # even an infinite atol
    assert not is_close(ref[:3], ref, tol)
