"""A rank's output and gradients compared with its reference slices: a passing rank finds
nothing, a failing one every mismatch, in order, wrong dtypes among them (verify/compare.py)."""

from __future__ import annotations

import torch

from shardverify import DeviceMesh
from shardverify.strategies.for_node import strategies_for_node
from shardverify.verify import compare as C
from shardverify.verify.layout import rank_layout
from shardverify.verify.reference import reference
from shardverify.verify.report import Mismatch
from shardverify.verify.tolerance import tolerance_for

from tests.test_verify_engine import LINEAR

MESH = DeviceMesh((2, 2))
RANK = 3


def entries(strategy):
    """Rank RANK's output and gradients of ``strategy`` as it should hold them (float32 copies
    of its reference slices), as rank_check hands them to compare_all."""
    ref = reference(LINEAR, None, torch.device("cpu"))
    layout = rank_layout(strategy, MESH, RANK)
    found = [("output", layout.outputs[0].shard(ref.outputs[0], MESH, RANK).float(), ref.outputs[0],
              layout.outputs[0], None)]
    for operand in layout.inputs:
        loc = (operand.data.locator.kind, operand.data.locator.key)
        found.append((f"grad of {operand.data.name}", operand.shard(ref.grads[loc], MESH, RANK).float(),
                      ref.grads[loc], operand, None))
    return found


def one_by_one(items):
    return [m for item in items for m in (item if isinstance(item, list) else
                                          C._compare(RANK, *item, MESH, tolerance_for(item[1].dtype)))]


def test_a_passing_rank_finds_nothing_and_a_failing_one_each_mismatch_in_order():
    graph_module, node_name = LINEAR.build()
    strategy = next(s for s in strategies_for_node(graph_module, node_name, MESH) if s.name.startswith("S0S1"))
    good = entries(strategy)
    assert len(good) == 4 and C.compare_all(RANK, good, MESH, tolerance_for) == []
    wrong = list(good)
    label, actual, *rest = wrong[2]
    wrong[2] = (label, actual + 1e-2, *rest)   # one gradient off
    label, actual, *rest = wrong[3]
    broken = actual.clone()
    broken.view(-1)[0] = float("nan")          # a NaN passes no bound: compared alone, reported as such
    wrong[3] = (label, broken, *rest)
    wrong.insert(1, [Mismatch("dtype", RANK, "output", detail="dtype float64, the single-device op gives float32")])
    found = C.compare_all(RANK, wrong, MESH, tolerance_for)
    assert found == one_by_one(wrong)
    assert [(m.kind, m.tensor) for m in found] == [("dtype", "output"), ("values", wrong[3][0]),
                                                   ("values", wrong[4][0])]
    assert "nan" in found[2].detail.lower()


def test_float32_results_at_the_edge_of_their_bounds_get_the_float64_rule_s_verdict():
    """The cheap path compares a float32 result with float32 bounds rounded inward: for values
    one float32 step either side of each float64 bound, every verdict (and every figure of a
    mismatch) is the one ``compare`` gives in float64."""
    from shardverify.sharding.sharding_spec import ShardingSpec
    from shardverify.verify.layout import LocalOperand
    from shardverify.verify.tolerance import Tolerance, compare

    expected = torch.cat([torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 100,
                          torch.tensor([0.0, 1e-30, -3.5, 1e38, 0.1], dtype=torch.float64)])
    tol = tolerance_for(torch.float32)
    allowed = expected.abs() * tol.rtol + tol.atol
    probes = []
    for edge in (expected - allowed, expected + allowed):
        near = edge.to(torch.float32)
        for step in (float("-inf"), float("inf")):
            probes += [near, torch.nextafter(near, torch.full_like(near, step))]
    mesh = DeviceMesh((1,))
    for tolerance in (tol, Tolerance(0.0, 0.0)):
        for probe in probes:
            for i in range(expected.numel()):
                full = expected[i:i + 1].clone()
                operand = LocalOperand(None, ShardingSpec((1,), (1,)), (slice(0, 1),), (1,))
                found = C._compare(0, "x", probe[i:i + 1], full, operand, None, mesh, tolerance)
                want = compare(probe[i:i + 1], full, tolerance)
                assert (found == []) == want.close, (float(probe[i]), float(full), tolerance)
                if found:
                    assert (found[0].max_abs_err, found[0].max_rel_err) == (want.max_abs_err, want.max_rel_err)


def test_a_partial_extremum_s_gradient_gets_the_float64_rule_s_verdict_against_its_masked_reference():
    """A piece of a partial max/min input is checked against ``where(holds, expected, 0)``; the
    cheap path takes those bounds elementwise from the slice's and zero's.  At one float32 step
    either side of each bound, inside and outside what the piece holds, every verdict (and
    figure) is the one ``compare`` gives the masked reference in float64; the unmasked gradient
    fails."""
    from shardverify.sharding.sharding_spec import ShardingSpec
    from shardverify.verify.layout import LocalOperand
    from shardverify.verify.tolerance import Tolerance, compare

    expected = torch.randn(2, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 10
    holds = torch.tensor([[True, False, True, False, True, False], [False, True, False, True, False, True]])
    operand = LocalOperand(None, ShardingSpec((1,), (2, 6)), (slice(0, 2), slice(0, 6)), (2, 6))
    mesh = DeviceMesh((1,))
    for tol in (tolerance_for(torch.float32), Tolerance(0.0, 0.0)):
        masked = torch.where(holds, expected, torch.zeros((), dtype=torch.float64))
        allowed = masked.abs() * tol.rtol + tol.atol
        for edge in (masked - allowed, masked + allowed):
            near = edge.to(torch.float32)
            for step in (float("-inf"), float("inf")):
                for probe in (near, torch.nextafter(near, torch.full_like(near, step))):
                    for i in range(masked.numel()):   # one element moved to the probe, the rest exact
                        actual = masked.to(torch.float32).flatten()
                        actual[i] = probe.flatten()[i]
                        actual = actual.reshape(masked.shape)
                        found = C._compare(0, "x", actual, expected.clone(), operand, holds, mesh, tol)
                        want = compare(actual, masked, tol)
                        assert (found == []) == want.close, (i, float(actual.flatten()[i]), tol)
                        if found:
                            assert (found[0].max_abs_err, found[0].max_rel_err) == (want.max_abs_err,
                                                                                    want.max_rel_err)
        # the whole gradient on a piece that holds half of it: wrong wherever it does not hold
        assert C._compare(0, "x", expected.to(torch.float32), expected.clone(), operand, holds, mesh, tol)


def test_a_large_result_out_of_bound_is_measured_in_pieces_with_compare_s_figures():
    """Out of bound, a result of over 65,536 elements is measured a piece of its leading dim at a
    time: the verdict and both error figures are still ``compare``'s on the whole tensor, and a
    NaN in a later piece is still reported as one."""
    from shardverify.sharding.sharding_spec import ShardingSpec
    from shardverify.verify.layout import LocalOperand
    from shardverify.verify.tolerance import compare

    gen = torch.Generator().manual_seed(1)
    for shape in ((5, 40000), (150000,), (3, 70000)):
        full = torch.randn(shape, generator=gen, dtype=torch.float64)
        got = (full + 1e-4 * torch.randn(shape, generator=gen, dtype=torch.float64)).float()
        operand = LocalOperand(None, ShardingSpec((1,), shape), tuple(slice(0, n) for n in shape), shape)
        found = C._compare(0, "x", got, full, operand, None, DeviceMesh((1,)), tolerance_for(got.dtype))
        want = compare(got, full, tolerance_for(torch.float32))
        assert not want.close and (found[0].max_abs_err, found[0].max_rel_err) == (want.max_abs_err,
                                                                                  want.max_rel_err)
        got.view(-1)[-1] = float("nan")
        found = C._compare(0, "x", got, full, operand, None, DeviceMesh((1,)), tolerance_for(got.dtype))
        assert "nan" in found[0].detail.lower()


def test_a_slice_s_bounds_taken_from_the_whole_tensor_s_are_its_own():
    """The bounds of a reference slice are views of the whole tensor's (worked out once), the
    same numbers as the slice's own; a whole holding an inf leaves a finite slice its own."""
    full = torch.randn(8, 6, dtype=torch.float64) * 1e3
    tol = tolerance_for(torch.float32)
    slices = (slice(2, 6), slice(3, 6))
    for narrow in (True, False):
        own = C._bound(full[slices], tol, narrow, {})
        shared = C._slice_bound(full, slices, full[slices], tol, narrow, {})
        assert all(torch.equal(a, b) for a, b in zip(own, shared))
    full[0, 0] = float("inf")
    C._WHOLE.clear()
    kept: dict = {}
    own = C._bound(full[slices], tol, True, {})
    shared = C._slice_bound(full, slices, full[slices], tol, True, kept)
    assert all(torch.equal(a, b) for a, b in zip(own, shared)) and ("allowed", tol.rtol, tol.atol) in kept
    assert C._slice_bound(full, (slice(0, 2), slice(0, 2)), full[:2, :2], tol, True, {}) is None

