"""Resharding: the plans it makes, its cost, and that the pair check catches a wrong step."""

from __future__ import annotations

import pytest

import shardverify.reshard as reshard
from shardverify.mesh import DeviceMesh
from shardverify.reshard import Layout, ReshardStep, plan_reshard, reshard_cost
from shardverify.reshard_check import ReshardCase, enumerate_layouts, layout_pairs, rank_check_pairs

MESH = (2, 2)


def L(text, shape=(8, 8)):
    return Layout.parse(text, shape, MESH)


@pytest.mark.parametrize("src, tgt, steps", [
    ("[S0, R]", "[R, S01]", [ReshardStep("all_to_all", (0,), (1, 0)), ReshardStep("split", (1,), (1,))]),
    ("[R, R] P0", "[S0, R]", [ReshardStep("reduce_scatter", (0,), (0,))]),
    ("[R, R] P01", "[S1, R]", [ReshardStep("reduce_scatter", (1,), (0,)), ReshardStep("all_reduce", (0,))]),
    ("[S01, R]", "[S0, R]", [ReshardStep("all_gather", (1,), (0,))]),
    ("[S10, R]", "[S0, R]", [ReshardStep("all_gather", (1, 0), (0,)), ReshardStep("split", (0,), (0,))]),
    ("[R, R]", "[R, R] P1", [ReshardStep("zero_partial", (1,))]),
    ("[S0, S1]", "[S0, S1]", []),
])
def test_plan_reshard(src, tgt, steps):
    assert list(plan_reshard(L(src), L(tgt))) == steps


def test_partial_and_sharded_on_one_axis_is_refused():
    with pytest.raises(Exception, match="both sharded and partial"):
        L("[S0, R] P0")


def test_cost_grows_with_the_communication():
    mesh = DeviceMesh(MESH)
    free = reshard_cost(mesh, L("[R, R]"), plan_reshard(L("[R, R]"), L("[S0, R]")), 4)
    gather = reshard_cost(mesh, L("[S01, R]"), plan_reshard(L("[S01, R]"), L("[R, R]")), 4)
    assert 0 < free < gather
    assert reshard_cost(mesh, L("[S0, R]"), (), 4) == 0.0


def test_pruning_keeps_every_orbit_once():
    mesh = DeviceMesh((2, 2))
    full, kept = layout_pairs(mesh, (8, 8), prune=False), layout_pairs(mesh, (8, 8))
    assert len(enumerate_layouts(MESH, (8, 8))) ** 2 == len(full) > len(kept)
    assert set(kept) <= set(full)
    assert layout_pairs(DeviceMesh((2, 4)), (8, 16)) == layout_pairs(DeviceMesh((2, 4)), (8, 16), prune=False)


def test_pair_check_catches_a_wrong_step(sv_backend, monkeypatch):
    backend = sv_backend(MESH, "simulated")
    case = ReshardCase(MESH, (8, 8), (("[S0, R]", "[R, R]"), ("[R, R] P0", "[R, S0]")))
    assert all(not lines for lines in backend.run(rank_check_pairs, case))
    original = reshard.plan_reshard

    def wrong_axis(source, target):   # gathers over the other mesh axis
        return tuple(ReshardStep(s.kind, tuple(1 - a for a in s.axes), s.dims) for s in original(source, target))

    monkeypatch.setattr("shardverify.reshard_check.plan_reshard", wrong_axis)
    planted = ReshardCase(MESH, (8, 8), case.pairs, seed=1)   # a new case: plans are cached per case
    failures = [line for lines in backend.run(rank_check_pairs, planted) for line in lines]
    assert failures and "[S0, R] -> [R, R]" in failures[0]
