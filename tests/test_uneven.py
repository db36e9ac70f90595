"""Uneven blocks and shard orders: the rules offer them where they hold, the verifier catches
each planted way of getting them wrong, naming the strategy and the tensor.

The planted bugs are the ones upstream reports cluster on: a partial average over blocks of
unequal size combined as if they were equal, blocks cut floor(n/k) instead of DTensor's
ceil(n/k), a dim split over two mesh axes in the other order (``S10`` read as ``S01``).
"""

from __future__ import annotations

import pytest
import torch

import shardverify.strategies.rules.generator as rules_generator
from shardverify.backends.simulated import SimulatedBackend
from shardverify.sharding.blocks import block_lengths, chunk_block, partial_refusal
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.sharding.strategy import LocalArg
from shardverify.spec.case import InputDecl, OpCase
from shardverify.strategies.for_node import CACHE_KEY, strategies_for_node
from shardverify.strategies.handlers.base import OperandDecl, ParamDecl
from shardverify.verify.engine import verify_case
from test_rules import IN0, OUT, handler   # a rules handler in place of the shipped one, for one test


def verify(case: OpCase, mesh_shape, strategies=None):
    backend = SimulatedBackend(DeviceMesh(mesh_shape))
    try:
        return verify_case(backend, case, strategies)
    finally:
        backend.close()


def strategies(case: OpCase, mesh_shape, fresh: bool = False):
    graph_module, node = case.build()
    if fresh:   # built again, not taken from the node's cache (a planted generator differs)
        next(n for n in graph_module.graph.nodes if n.name == node).meta.pop(CACHE_KEY, None)
    return strategies_for_node(graph_module, node, DeviceMesh(mesh_shape))


# ------------------------------------------------------------------ the block arithmetic

def test_blocks_are_cut_like_torch_chunk_and_what_cannot_stay_partial_says_why():
    assert [chunk_block(7, 4, i) for i in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 1)]
    assert [chunk_block(5, 4, i) for i in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    assert block_lengths(5, [2, 2]) == [2, 1, 1, 1]       # 3 + 2, then each halved
    assert block_lengths(12, [2, 3]) == [2] * 6
    assert partial_refusal("sum", 5, [3]) is None
    assert "avg over blocks of unequal size (2, 2, 1 of 5)" in partial_refusal("avg", 5, [3])
    assert partial_refusal("avg", 6, [3]) is None
    assert "empty block" in partial_refusal("max", 2, [3]) and partial_refusal("max", 5, [3]) is None


# ------------------------------------------------------------------ uneven rules pass

MEAN = OpCase(op="mean", target="torch.mean", inputs=(InputDecl("x", (4, 5)),), params=(("dim", 1),))
MEAN_OPTIONS = {"einsum": "mk->m", "reduce": (("k", "avg"),)}
MEAN_PARAMS = [ParamDecl("dim", 1, "dim")]


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 3), (3, 2), (5,), (6,), (4, 2), (2, 2, 2)])
def test_every_rule_on_sizes_that_do_not_divide_offers_uneven_strategies_and_they_pass(mesh_shape):
    case = OpCase(op="mm", target="torch.mm", inputs=(InputDecl("a", (7, 5)), InputDecl("b", (5, 3))))
    with handler("mm_rule", torch.mm, [IN0, OperandDecl("mat2", "input", 1, "mat2"), OUT],
                 {"einsum": "mk,kn->mn"}):
        offered = strategies(case, mesh_shape)
        uneven = [s for s in offered if not all(spec.is_even for _, spec in s.sharding_specs)]
        results = verify(case, mesh_shape)
    assert uneven and all(r.passed for r in results), [r.report() for r in results if not r.passed]


# ------------------------------------------------------------------ planted: partial avg

def test_a_partial_avg_over_unequal_blocks_is_not_offered_and_planted_it_is_caught(monkeypatch):
    """mean over 5 columns on 2 ranks: blocks of 3 and 2, whose means averaged with equal weights
    are not the mean. The rule leaves that dim whole; with the refusal planted away (a rule
    treating the blocks as equal) every partial strategy fails on its output."""
    with handler("mean_rule", torch.mean, [IN0, OUT], MEAN_OPTIONS, MEAN_PARAMS):
        assert not any("| P" in s.name for s in strategies(MEAN, (2,)))
        monkeypatch.setattr(rules_generator, "partial_refusal", lambda *args: None)
        planted = [s for s in strategies(MEAN, (2,), fresh=True) if "| P" in s.name]
        results = verify(MEAN, (2,), planted)
    assert planted and results and all(not r.passed for r in results)
    report = results[0].report()
    assert results[0].strategy in report and "output" in report and "P0 avg" in report


def test_a_partial_avg_over_equal_blocks_is_offered_and_passes():
    even = OpCase(op="mean", target="torch.mean", inputs=(InputDecl("x", (4, 6)),), params=(("dim", 1),))
    with handler("mean_rule", torch.mean, [IN0, OUT], MEAN_OPTIONS, MEAN_PARAMS):
        partial = [s for s in strategies(even, (3,)) if "| P0 avg" in s.name]
        results = verify(even, (3,), partial)
    assert partial and all(r.passed for r in results)


# ------------------------------------------------------------------ planted: floor blocks

def _floor_shapes(size: int, parts: int) -> list[int]:
    """Blocks of floor(n/k), the last one taking the rest: the off-by-one chunking."""
    base = size // parts
    return [base] * (parts - 1) + [size - base * (parts - 1)]


def test_local_shapes_of_floor_blocks_instead_of_ceil_are_caught():
    """A reshape whose ranks pass their local shape: 7 rows over 3 ranks are 3, 3, 1 as DTensor
    cuts them. A rule that tells each rank floor(7/3) = 2 rows (the last taking 3) makes every
    rank's op refuse its block, named with the strategy and the local argument it passed."""
    case = OpCase(op="reshape", target="torch.reshape", inputs=(InputDecl("x", (7, 4, 2)),),
                  params=(("shape", (7, 8)),))
    with handler("reshape_rule", torch.reshape, [IN0, OUT], {"view": "reshape", "shape_param": "shape"},
                 [ParamDecl("shape", 1, "shape", varargs=True)]):
        offered = strategies(case, (3,))
        rows = [s for s in offered if str(s.output_sharding_spec) == "[S0, R]"]
        assert len(rows) == 1 and rows[0].local_args[0].per_rank == ((3, 8), (3, 8), (1, 8))
        floor = [(n, 8) for n in _floor_shapes(7, 3)]
        planted = rows[0].replace(local_args=(LocalArg(rows[0].local_args[0].locator, floor[0], tuple(floor)),))
        good, bad = verify(case, (3,)), verify(case, (3,), [planted])
    assert all(r.passed for r in good)
    assert not bad[0].passed
    report = bad[0].report()
    assert "[S0, R]" in report or rows[0].name in report
    assert "local argument" in report and "(2, 8)" in report


# ------------------------------------------------------------------ planted: S10 read as S01

@pytest.mark.parametrize("k", [16, 10])
def test_a_contraction_split_in_the_other_order_on_one_operand_is_caught(k):
    """mm with k over both axes of a 2 x 2 mesh: both operands must cut k in the same order.
    Cutting the second operand S10 while the first is S01 pairs the wrong blocks (even k: the
    middle two swap; uneven k: the sizes differ too)."""
    case = OpCase(op="mm", target="torch.mm", inputs=(InputDecl("a", (4, k)), InputDecl("b", (k, 4))))
    with handler("mm_rule", torch.mm, [IN0, OperandDecl("mat2", "input", 1, "mat2"), OUT],
                 {"einsum": "mk,kn->mn"}):
        offered = strategies(case, (2, 2))
        right = next(s for s in offered if s.name == "RS01 x S01R -> RR | P01 sum")
        b = right.operands[1].name
        spec = right.get_sharding_spec_by_name(b)
        swapped = ShardingSpec.from_partition(spec.mesh_shape, spec.tensor_shape, {0: (1, 0)})
        planted = right.replace(sharding_specs=tuple((n, swapped if n == b else s) for n, s in right.sharding_specs))
        good, bad = verify(case, (2, 2), [right]), verify(case, (2, 2), [planted])
    assert good[0].passed
    assert not bad[0].passed
    report = bad[0].report()
    assert right.name in report
    # even blocks: the op runs and the output is wrong; uneven: the blocks do not even pair up
    assert ("output" in report) if k == 16 else (f"{b}: layout [S10, R]" in report and "rank 1 raised" in report)


def test_the_rules_offer_both_shard_orders_of_a_dim_and_each_passes_on_its_own_blocks():
    """7 rows over (2, 3): S01 cuts over axis 0 first (4 + 3, then each 3 ways), S10 over axis 1
    first (3 + 3 + 1, then each 2 ways): other rows on most ranks, both offered, both verified."""
    case = OpCase(op="mm", target="torch.mm", inputs=(InputDecl("a", (7, 5)), InputDecl("b", (5, 3))))
    with handler("mm_rule", torch.mm, [IN0, OperandDecl("mat2", "input", 1, "mat2"), OUT],
                 {"einsum": "mk,kn->mn"}):
        offered = strategies(case, (2, 3), fresh=True)
        results = verify(case, (2, 3), offered)
    names = {s.name for s in offered}
    assert {"S01R x RR -> S01R", "S10R x RR -> S10R", "RS01 x S01R -> RR | P01 sum",
            "RS10 x S10R -> RR | P01 sum"} <= names
    assert all(r.passed for r in results), [r.report() for r in results if not r.passed]


def test_a_view_of_a_batch_split_over_more_ranks_than_rows_passes_each_rank_its_own_block():
    """A T5-style head split (``x.view(b, s, heads, d)``) of 2 batch rows over 4 ranks (``S01``):
    blocks of 1, 0, 1, 0 rows, each rank passing its own block's shape (0 rows on the empty ones),
    forward and backward."""
    case = OpCase(op="view", target="torch.Tensor.view", inputs=(InputDecl("x", (2, 8, 32)),),
                  params=(("size", (2, 8, 2, 16)),))
    wanted = [s for s in strategies(case, (2, 2)) if s.name == "S01RR -> S01RRR"]
    assert wanted and [a.per_rank for a in wanted[0].local_args] == \
        [((1, 8, 2, 16), (0, 8, 2, 16), (1, 8, 2, 16), (0, 8, 2, 16))]
    results = verify(case, (2, 2), wanted)
    assert all(r.passed for r in results), [r.report() for r in results if not r.passed]
