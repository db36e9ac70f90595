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
                                          C._compare(RANK, *item, MESH, tolerance_for))]


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
