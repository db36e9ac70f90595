"""Every rank of a mesh in one thread (backends/stacked.py): the strategy check's form on the
simulated mesh must find exactly what one thread per rank finds, and its collectives must
count, reduce and fail as each rank's communicator does."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from shardverify import DeviceMesh
from shardverify.backends import SimulatedBackend
from shardverify.backends.stacked import AllRanks
from shardverify.errors import CollectiveError, RankError, RankTimeout
from shardverify.spec.case import InputDecl, ModuleDecl, OpCase
from shardverify.strategies.for_node import strategies_for_node
from shardverify.verify.engine import verify_case

LINEAR = OpCase(op="linear", target="torch.nn.Linear", inputs=(InputDecl("input", (4, 6, 16)),),
                module=ModuleDecl("torch.nn.Linear", (16, 12), (("bias", True),)))
SUM = OpCase(op="sum", target="torch.sum", inputs=(InputDecl("input", (4, 6, 8)),), params=(("dim", (0, 2)),),
             predecessor=ModuleDecl("torch.nn.Linear", (8, 8), (("bias", False),)))
EMBEDDING = OpCase(op="embedding", target="torch.nn.Embedding",
                   inputs=(InputDecl("input", (4, 6), dtype="int64", values=(0, 12)),),
                   module=ModuleDecl("torch.nn.Embedding", (12, 8)))


def _both(mesh: DeviceMesh, case: OpCase, limit: int = 40):
    """Results of the case's distinct strategies (and, for each with actions, the same layouts
    with its actions dropped: wrong results to find) on the stacked and the threaded mesh."""
    graph_module, node_name = case.build()
    firsts: dict = {}
    for strategy in strategies_for_node(graph_module, node_name, mesh):
        firsts.setdefault(strategy.layout_key(), strategy)
    chosen = list(firsts.values())[:limit]
    chosen += [dataclasses.replace(s, name=f"{s.name} without its actions", communication_actions=())
               for s in chosen if s.communication_actions][:10]
    found = []
    for stacked in (True, False):
        with SimulatedBackend(mesh, timeout=60, stacked=stacked) as backend:
            found.append(verify_case(backend, case, chosen))
    return found


@pytest.mark.parametrize("case", [LINEAR, SUM, EMBEDDING], ids=["linear", "sum", "embedding"])
@pytest.mark.parametrize("shape", [(2, 2), (3,)], ids=["2x2", "3-uneven"])
def test_the_stacked_check_finds_what_one_thread_per_rank_finds(case, shape):
    stacked, threaded = _both(DeviceMesh(shape), case)
    assert any(not r.passed for r in threaded), "the dropped actions must make some strategy fail"
    assert any(r.passed for r in threaded)
    for one, other in zip(stacked, threaded):
        assert (one.strategy, one.mismatches, one.note) == (other.strategy, other.mismatches, other.note), \
            f"{one.report()}\n-- threaded --\n{other.report()}"


def _threaded_collective(mesh: DeviceMesh, kind: str, inputs: list):
    """Each rank's result of one collective, with its counts and traffic, one thread per rank."""
    def per_rank(comm, tensors):
        t = tensors[comm.rank]
        out = getattr(comm, kind)(t, (0,)) if kind != "all_reduce" else comm.all_reduce(t, (0,), "max")
        return out, dict(comm.counts), dict(comm.traffic)

    with SimulatedBackend(mesh, timeout=30) as backend:
        return backend.run(per_rank, inputs)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "all_to_all"])
def test_a_collective_over_all_ranks_gives_each_rank_its_communicators_result_and_counts(kind):
    mesh = DeviceMesh((4,))
    torch.manual_seed(0)
    inputs = [torch.randn(6, 3) for _ in range(4)]
    if kind == "all_to_all":
        inputs = [list(t.split(3, 0)) + [t[:3] * 2, t[:3] - 1] for t in inputs]
    want = _threaded_collective(mesh, kind, inputs)
    ranks = AllRanks(mesh)
    got = {"all_reduce": lambda: ranks.all_reduce(inputs, (0,), "max"),
           "all_gather": lambda: ranks.all_gather(inputs, (0,)),
           "all_to_all": lambda: ranks.all_to_all(inputs, (0,))}[kind]()
    for rank, (out, counts, traffic) in enumerate(want):
        assert dict(ranks.comms[rank].counts) == counts and dict(ranks.comms[rank].traffic) == traffic
        outs, mine = (out, got[rank]) if isinstance(out, list) else ([out], [got[rank]])
        assert all(torch.equal(a, b) for a, b in zip(outs, mine))
    results = [t for r in got for t in (r if isinstance(r, list) else [r])]
    assert len({t.data_ptr() for t in results}) == len(results), "every result is a tensor no other rank holds"


def test_ranks_calling_a_collective_with_different_shapes_disagree_as_on_a_process_group():
    ranks = AllRanks(DeviceMesh((2, 2)))
    with pytest.raises(CollectiveError, match="ranks disagree"):
        ranks.all_reduce([torch.zeros(2), torch.zeros(2), torch.zeros(3), torch.zeros(3)], (0,), "sum")
    with pytest.raises(CollectiveError, match="cannot run a collective alone"):
        ranks.comms[0].all_reduce(torch.zeros(2), (0,))


def _plain(comm, value):
    return value


def test_a_failure_in_the_all_ranks_form_names_its_rank_and_a_hang_times_out():
    class Raised(Exception):
        rank = 2

    def all_ranks(ranks, value):
        if value == "raise":
            raise Raised("the op raised here")
        if value == "hang":
            threading.Event().wait(5)
        return [value] * len(ranks.comms)

    def fn(comm, value):  # the per-rank form: not run on a stacked mesh
        raise AssertionError("the all-ranks form runs instead")

    fn.all_ranks = all_ranks
    with SimulatedBackend(DeviceMesh((2, 2)), timeout=0.5) as backend:
        assert backend.run(fn, "fine") == ["fine"] * 4
        outcomes = backend.run_batch(fn, [("fine",), ("raise",), ("fine",)])
        assert outcomes[0] == ["fine"] * 4 and outcomes[2] == ["fine"] * 4
        assert isinstance(outcomes[1], RankError) and outcomes[1].rank == 2 and "the op raised here" in str(outcomes[1])
        with pytest.raises(RankTimeout, match="one thread"):
            backend.run(fn, "hang")
        assert backend.run(fn, "again") == ["again"] * 4   # a new thread took the hung one's place
    with SimulatedBackend(DeviceMesh((2,)), stacked=False) as threaded:
        assert threaded.run(_plain, 7) == [7, 7]


def _costed_wrong(strategy):
    """The strategy declaring one more all-reduce's worth of forward communication than it issues."""
    cost = strategy.communication_cost
    return dataclasses.replace(strategy, name=f"{strategy.name} costed wrong",
                               communication_cost=dataclasses.replace(cost, fwd=cost.fwd + 1.0))


@pytest.mark.parametrize("case, shape, rows", [(LINEAR, (2, 2), False), (SUM, (2, 2), False), (SUM, (2, 2, 2), False),
                                               (EMBEDDING, (2, 2), False), (LINEAR, (2, 2), True)],
                         ids=["linear-2x2", "sum-2x2", "sum-2x2x2", "embedding-2x2", "linear-2x2-row-by-row"])
def test_an_even_layout_checked_at_once_reports_and_counts_what_the_rank_by_rank_check_does(case, shape, rows,
                                                                                            monkeypatch):
    """verify/together.py: every rank of an even layout in one batch.  It passes a strategy only where
    the rank-by-rank check passes it, with the same collectives counted on every rank's communicator
    (calls and bytes); everything else (a wrong action, a wrong cost, ragged blocks) goes to the
    rank-by-rank check, which reports as it always does.  ``rows``: every result compared against its
    bounds row by row, as a large one is."""
    from shardverify.verify import compare, rank, together

    if rows:
        monkeypatch.setattr(compare, "_STACKED_MOST", 0)
    mesh = DeviceMesh(shape)
    graph_module, node_name = case.build()
    firsts: dict = {}
    for strategy in strategies_for_node(graph_module, node_name, mesh):
        firsts.setdefault(strategy.layout_key(), strategy)
    chosen = list(firsts.values())
    chosen += [dataclasses.replace(s, name=f"{s.name} without its actions", communication_actions=())
               for s in chosen if s.communication_actions][:8]
    chosen += [_costed_wrong(s) for s in chosen if s.communication_actions][:4]
    taken = []
    at_once = together._together
    monkeypatch.setattr(together, "_together", lambda *a: taken.append(at_once(*a)) or taken[-1])
    for strategy in chosen * 2:   # the second time every kind of call is counted: the batch takes it
        both = []
        for check in (together.ranks_check, rank.ranks_check):
            ranks = AllRanks(mesh)
            reports = check(ranks, case, strategy)
            both.append((reports, [(dict(c.counts), dict(c.traffic)) for c in ranks.comms]))
        assert both[0] == both[1], strategy.name
    batched = [found for found in taken if found is not None]
    assert len(batched) >= len(firsts) // 2, f"{len(batched)} of {len(taken)} checks ran every rank at once"
    assert all(not any(r.mismatches for r in found) for found in batched)
    assert any(any(r.mismatches for r in rank.ranks_check(AllRanks(mesh), case, s)) for s in chosen)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2), (3, 2), (2, 2, 2)], ids=str)
def test_every_ranks_block_stacked_is_its_own_slice(mesh_shape):
    """verify/layout.py's stacked_shards: row r is rank r's block (``ShardingSpec.local_shard``), for
    every even layout of a few tensors, dims split over one axis or several in either order, mesh
    axes splitting nothing repeating it; and a contiguous tensor of its own, never a view of the
    whole: each row has the strides of a rank's own copy of its block, on which a kernel (a
    matmul's weight gradient) may sum in another order than on a row of other strides."""
    import itertools

    from shardverify.sharding.sharding_spec import ShardingSpec
    from shardverify.verify.layout import stacked_shards

    mesh, checked = DeviceMesh(mesh_shape), 0
    for shape in [(12, 6), (4, 6, 12), (24,), ()]:
        whole = torch.randn(shape)
        for owners in itertools.product(range(-1, len(shape)), repeat=len(mesh_shape)):
            split: dict = {}
            for axis, dim in enumerate(owners):
                if dim >= 0:
                    split.setdefault(dim, []).append(axis)
            for orders in itertools.product(*(itertools.permutations(axes) for axes in split.values())):
                spec = ShardingSpec(mesh_shape, shape, tuple(zip(split, orders)))
                blocks = [spec.local_shard(whole, mesh, rank) for rank in range(mesh.size)]
                if len({tuple(b.shape) for b in blocks}) != 1:
                    with pytest.raises(ValueError, match="does not split evenly"):
                        stacked_shards(whole, spec)
                    continue
                stacked = stacked_shards(whole, spec)
                assert all(torch.equal(stacked[rank], block) for rank, block in enumerate(blocks)), spec
                assert stacked.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
                assert stacked.is_contiguous(), (spec, stacked.stride())
                checked += 1
    assert checked >= 8


@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 2)], ids=str)
def test_every_ranks_piece_of_a_partial_input_stacked_is_the_piece_it_takes(shape):
    """verify/rank_inputs.py's stacked_pieces: row r is what rank r takes of a partial input (its
    piece of its block, ``rank_blocks``), for every even layout of sum's partial inputs."""
    from shardverify.verify.layout import rank_layouts
    from shardverify.verify.rank import _reference
    from shardverify.verify.rank_inputs import rank_blocks, stacked_pieces

    mesh = DeviceMesh(shape)
    ref = _reference(SUM, None, torch.device("cpu"))
    graph_module, node_name = SUM.build()
    checked = 0
    for strategy in strategies_for_node(graph_module, node_name, mesh):
        layouts = rank_layouts(strategy, mesh, tuple(range(mesh.size)))
        partial = strategy.partial_input(layouts[0].inputs[0].data.name)
        if partial is None or not all(layout.holds_largest for layout in layouts):
            continue
        stacked = stacked_pieces(ref, layouts[0].inputs[0], 0, mesh, partial.axes, partial.op)
        blocks = rank_blocks(ref, strategy, [layout.inputs[0] for layout in layouts], 0, mesh, list(range(mesh.size)))
        assert stacked is not None and torch.equal(stacked, torch.stack(blocks)), strategy.name
        checked += 1
    assert checked


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("axes", [(0,), (1,), (2,), (0, 2), (2, 0), (0, 1, 2)], ids=str)
def test_an_all_reduce_of_every_rank_at_once_is_each_ranks_own_bit_for_bit(op, axes):
    """backends/stacked.py's RanksAtOnce: every rank's row reduced over its group, bit-identical to
    AllRanks' all-reduce of the same tensors, and every communicator counting the same call and bytes."""
    from shardverify.backends.stacked import RanksAtOnce

    mesh = DeviceMesh((2, 2, 2))
    torch.manual_seed(1)
    rows = [torch.randn(3, 5) * 10 ** r for r in range(mesh.size)]   # magnitudes apart: the order of the adds shows
    each, together = AllRanks(mesh), AllRanks(mesh)
    want = each.all_reduce(rows, axes, op)
    got = RanksAtOnce(together).all_reduce([torch.stack(rows)], axes, op)[0]
    assert all(torch.equal(got[rank], want[rank]) for rank in range(mesh.size))
    assert [(dict(c.counts), dict(c.traffic)) for c in together.comms] == \
        [(dict(c.counts), dict(c.traffic)) for c in each.comms]
    with pytest.raises(CollectiveError, match="only the all-reduce"):
        RanksAtOnce(together).all_gather([torch.stack(rows)], axes)
