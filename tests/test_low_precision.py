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
from shardverify.sharding.strategy import CommPattern, CommWhere
from shardverify.spec.case import InputDecl, ModuleDecl, OpCase
from shardverify.verify.engine import verify_strategy
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


@pytest.fixture
def partials_reduced_in_a_lower_dtype(monkeypatch):
    """The planted bug: the partial outputs of a float16 run are summed in float8 (e5m2) and
    cast back; float32 and float64 runs are untouched, so the maths is exact there."""
    def sloppy(ranks, action, ts):
        if ts[0].dtype is not torch.float16:
            return ranks.all_reduce([t.contiguous() for t in ts], action.axes, "sum")
        low = [t.to(torch.float8_e5m2).to(torch.float16).to(torch.float32).contiguous() for t in ts]
        return [total.to(torch.float8_e5m2).to(torch.float16) for total in ranks.all_reduce(low, action.axes, "sum")]

    halves = dict(patterns._HALVES)
    halves[CommPattern.ALLREDUCE_FWD_IDENTITY_BWD] = (sloppy, patterns._identity)
    monkeypatch.setattr(patterns, "_HALVES", halves)


def test_the_single_device_error_is_measured_in_the_dtype():
    outputs16, grads16 = single_device_errors(LINEAR, torch.float16)
    outputs64, grads64 = single_device_errors(LINEAR, torch.float64)
    assert outputs16[0] > 0 and all(e > 0 for e in grads16.values())
    assert outputs64[0] < outputs16[0] * 1e-6
    assert set(grads16) == {("arg", 0), ("param", "weight")}


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

    halves = dict(patterns._HALVES)
    halves[CommPattern.ALLREDUCE_FWD_IDENTITY_BWD] = (off, patterns._identity)
    monkeypatch.setattr(patterns, "_HALVES", halves)
    result = verify_strategy(mesh4, LINEAR, partial_output_strategy(mesh4), dtype="float16")
    assert not result.passed
    assert result.note.startswith("wrong maths: the float64 re-check fails too"), result.note
