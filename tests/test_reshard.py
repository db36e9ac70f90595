"""Resharding: the plans it makes, its cost, and that the pair check catches a wrong step."""

from __future__ import annotations

import pytest
import torch

import shardverify.sharding.reshard_plan as reshard
from shardverify.errors import ShardingSpecError
from shardverify.sharding.layout import Layout, ShapedLayout
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.reshard_plan import ReshardStep, plan_reshard, reshard_cost
from shardverify.features.reshard.check import ReshardCase, check_reshard, enumerate_layouts, layout_pairs, rank_check_pairs

MESH = (2, 2)


def L(text, shape=(8, 8)):
    return ShapedLayout.parse(text, shape, MESH)


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


def test_a_shaped_layout_is_the_layout_bound_to_a_tensor_and_mesh_shape():
    shaped = L("[S0, R] P1", (8, 6))
    assert shaped.layout == Layout(((0,), ()), (1,)) and shaped.partial == (1,) and shaped.axes == {0: (0,)}
    assert (str(shaped), str(shaped.layout)) == ("[S0, R] P1", "[S0, R] P(sum:1)")
    assert shaped == ShapedLayout(Layout(((0,), ()), (1,)), (8, 6), MESH) == ShapedLayout.of_spec(shaped.spec, (1,))
    assert shaped != L("[S0, R] P1", (8, 8))      # another shape moves other bytes: another edge cost
    assert shaped.local_shape() == (4, 6)
    for refused in (Layout(((0,), ()), (1,), "max"), Layout(((0,), ()), absent=True)):
        with pytest.raises(ShardingSpecError, match="partial sums only"):
            ShapedLayout(refused, (8, 6), MESH)


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

    monkeypatch.setattr("shardverify.features.reshard.check.plan_reshard", wrong_axis)
    planted = ReshardCase(MESH, (8, 8), case.pairs, seed=1)   # a new case: plans are cached per case
    failures = [line for lines in backend.run(rank_check_pairs, planted) for line in lines]
    assert failures and "[S0, R] -> [R, R]" in failures[0]


def _fails_in_the_second_chunk(comm, case):
    if case.first and comm.rank == 1:
        raise RuntimeError("planted")
    return []


def test_check_reshard_checks_chunks_with_each_pairs_own_values(sv_backend, monkeypatch):
    """The pairs go to the ranks CHUNK_PAIRS at a time, one check each in one batch (each under
    the per-check timeout); a pair's values are seeded by its place among all the pairs, so a
    chunk checks exactly what one call over every pair would, and a chunk that fails as a
    whole raises the backend's error."""
    from shardverify.features.reshard import check as reshard_check
    from shardverify.errors import RankError

    pairs = tuple(layout_pairs(DeviceMesh(MESH), (8, 8)))
    monkeypatch.setattr(reshard_check, "CHUNK_PAIRS", 5)
    whole = reshard_check._prepare(ReshardCase(MESH, (8, 8), pairs, seed=3))[5:10]
    chunk = reshard_check._prepare(ReshardCase(MESH, (8, 8), pairs[5:10], seed=3, first=5))
    assert [(a.source, a.target) for a in whole] == [(b.source, b.target) for b in chunk]
    assert all(torch.equal(a.full, b.full) and torch.equal(a.grad, b.grad) for a, b in zip(whole, chunk))

    backend = sv_backend(MESH, "simulated")
    batches, real = [], backend.run_batch
    monkeypatch.setattr(backend, "run_batch", lambda fn, items, **kw: batches.append(items) or real(fn, items, **kw))
    assert check_reshard(backend, (8, 8), seed=3) == (len(pairs), [])
    assert [[case.first for case, in items] for items in batches] == [list(range(0, len(pairs), 5))]
    assert sum(len(case.pairs) for case, in batches[0]) == len(pairs)

    monkeypatch.setattr(reshard_check, "rank_check_pairs", _fails_in_the_second_chunk)
    with pytest.raises(RankError, match="planted"):
        check_reshard(backend, (8, 8), seed=3)
