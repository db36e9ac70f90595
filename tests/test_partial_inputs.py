"""Partial inputs: an op linear in an operand takes it as a partial sum (``linear_in``), the
verifier builds it from real random pieces per rank, and a partial input passed to an op that
is not linear in it fails naming the strategy and the tensor."""

from __future__ import annotations

import pytest
import torch

from shardverify.errors import StrategyError
from shardverify.sharding.pieces import partial_pieces
from shardverify.sharding.partial import PartialInput
from shardverify.spec.case import InputDecl, OpCase
from shardverify.strategies.handlers.base import OperandDecl
from test_rules import IN0, IN1, OUT, handler
from test_uneven import strategies, verify

MM = OpCase(op="mm", target="torch.mm", inputs=(InputDecl("a", (6, 5)), InputDecl("b", (5, 4))))
MAT2 = OperandDecl("mat2", "input", 1, "mat2")


def test_pieces_sum_to_the_value_and_each_differs_from_it_and_from_the_others():
    value = torch.randn(3, 4, dtype=torch.float64)
    pieces = partial_pieces(value, 3, seed=5)
    assert torch.allclose(pieces.sum(0), value)
    assert torch.equal(pieces, partial_pieces(value, 3, seed=5))         # every rank makes the same
    for i in range(3):
        assert not torch.allclose(pieces[i], value) and not torch.allclose(pieces[i], value / 3)
        assert not torch.allclose(pieces[i], pieces[(i + 1) % 3])
    assert pieces.abs().min() > 0                                         # no zero padding


def test_a_blocks_pieces_are_its_slice_of_the_whole_tensors_pieces():
    """What every layout of a case reads (verify/rank_inputs.py): the pieces of a whole tensor,
    sliced to a block, sum to the block, and each differs from the block's share and the others."""
    whole = torch.randn(6, 4, dtype=torch.float64)
    pieces = partial_pieces(whole, 2, seed=3)[:, 2:4]
    block = whole[2:4]
    assert torch.allclose(pieces.sum(0), block)
    assert not torch.allclose(pieces[0], pieces[1]) and not torch.allclose(pieces[0], block / 2)
    assert ((pieces > 0).any(0) & (pieces < 0).any(0)).all()   # both signs at every element


def test_whole_tensors_pieces_are_made_once_and_kept_within_their_byte_budget(monkeypatch):
    from shardverify.verify import rank_inputs

    monkeypatch.setattr(rank_inputs, "_WHOLE_PIECES", {})
    first, second = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    made = rank_inputs._whole_pieces(first, 2, seed=1)
    assert rank_inputs._whole_pieces(first, 2, seed=1) is made                 # once per tensor, count, seed, op
    assert torch.equal(rank_inputs._whole_pieces(first, 2, seed=1, op="max").amax(0), first)
    assert rank_inputs._whole_bytes() == 2 * made.nbytes
    monkeypatch.setattr(rank_inputs, "_WHOLE_BYTES", made.nbytes * 3 // 2)    # room for one set alone
    rank_inputs._whole_pieces(second, 2, seed=1)
    assert [owner for owner, _ in rank_inputs._WHOLE_PIECES.values()] == [second]
    assert rank_inputs._whole_bytes() == made.nbytes
    rank_inputs._WHOLE_PIECES.clear()                                          # as a benchmark empties the tables
    rank_inputs._whole_pieces(first, 2, seed=1)
    assert rank_inputs._whole_bytes() == made.nbytes                           # counted afresh, not on top
    monkeypatch.setattr(rank_inputs, "_WHOLE_MOST", 8 * 4 * 2 - 1)
    assert rank_inputs._whole_pieces(first, 2, seed=1) is None                 # too large: its blocks make their own


def test_two_of_the_largest_whole_tensor_pieces_fit_the_budget_together():
    """A case asks for a tensor's pieces over one mesh axis and over two, layout after layout: if
    the two did not fit together, each would empty the table of the other at every layout."""
    from shardverify.verify import rank_inputs

    assert 2 * rank_inputs._WHOLE_MOST * torch.finfo(torch.float64).bits // 8 <= rank_inputs._WHOLE_BYTES


@pytest.mark.parametrize("mesh_shape", [(2, 2), (3,), (2, 3)])
def test_a_product_takes_either_factor_as_a_partial_sum_and_every_such_strategy_passes(mesh_shape):
    with handler("mm_rule", torch.mm, [IN0, MAT2, OUT], {"einsum": "mk,kn->mn", "linear_in": ["input", "mat2"]}):
        offered = strategies(MM, mesh_shape, fresh=True)
        results = verify(MM, mesh_shape, offered)
    partial = [s for s in offered if s.partial_inputs]
    assert partial and all(r.passed for r in results), [r.report() for r in results if not r.passed]
    # both factors only over different axes: a product is linear in each, not in the pair
    assert all(len({p.axes for p in s.partial_inputs}) == len(s.partial_inputs) for s in partial)
    names = {s.name for s in partial}
    assert "RR+P0 x RR -> RR | P0 sum" in names and "RR x RR+P0 -> RR | P0 sum" in names
    if len(mesh_shape) == 2:   # a partial input beside a contraction sharded over the other axis
        assert "RS0+P1 x S0R -> RR | P01 sum" in names
        assert "RR+P0 x RR+P1 -> RR | P01 sum" in names   # rank (i, j): a_i @ b_j, summed over both


def test_add_takes_both_terms_as_partial_sums_together_never_one_alone():
    case = OpCase(op="add", target="torch.add", inputs=(InputDecl("x", (4, 6)), InputDecl("y", (4, 6))))
    with handler("add_rule", torch.add, [IN0, IN1, OUT], {"pointwise": True, "linear_in": [["input", "other"]]}):
        offered = strategies(case, (2, 2), fresh=True)
        results = verify(case, (2, 2), offered)
    partial = [s for s in offered if s.partial_inputs]
    assert partial and all(len(s.partial_inputs) == 2 for s in partial)
    assert all(r.passed for r in results), [r.report() for r in results if not r.passed]


@pytest.mark.parametrize("options", [
    {"pointwise": True, "linear_in": ["input"]},                          # relu is not linear
    {"pointwise": True, "linear_in": ["input", "other"]},                 # add is not linear in one term alone
    {"einsum": "mk,kn->mn", "linear_in": [["input", "mat2"]]},            # nor a product in both factors
], ids=["relu", "add-one-term", "mm-both"])
def test_a_partial_input_to_an_op_not_linear_in_it_is_caught_naming_strategy_and_tensor(options):
    if "einsum" in options:
        case, target, operands = MM, torch.mm, [IN0, MAT2, OUT]
    elif options["linear_in"] == ["input"]:
        case = OpCase(op="relu", target="torch.relu", inputs=(InputDecl("x", (4, 6)),))
        target, operands = torch.relu, [IN0, OUT]
    else:
        case = OpCase(op="add", target="torch.add", inputs=(InputDecl("x", (4, 6)), InputDecl("y", (4, 6))))
        target, operands = torch.add, [IN0, IN1, OUT]
    with handler("planted", target, operands, options):
        results = verify(case, (2, 2), strategies(case, (2, 2), fresh=True))
    failed = [r for r in results if not r.passed]
    partial = [r for r in results if "+P" in r.strategy]
    assert partial and failed
    assert {r.strategy for r in failed} == {r.strategy for r in partial}   # exactly the partial ones, all of them
    report = failed[0].report()
    assert failed[0].strategy in report and "output" in report


def test_a_partial_input_must_be_a_floating_input_on_axes_its_layout_leaves_free():
    with handler("mm_rule", torch.mm, [IN0, MAT2, OUT], {"einsum": "mk,kn->mn", "linear_in": ["input"]}):
        strategy = next(s for s in strategies(MM, (2, 2), fresh=True) if s.name == "S0R x RR -> S0R")
    a = strategy.inputs[0].name
    with pytest.raises(StrategyError, match=r"shards axes \[0\] already"):
        strategy.replace(partial_inputs=(PartialInput(a, (0,)),))
    with pytest.raises(StrategyError, match="not axes of mesh"):
        strategy.replace(partial_inputs=(PartialInput(a, (2,)),))
    with pytest.raises(StrategyError, match="floating-point input"):
        strategy.replace(partial_inputs=(PartialInput(strategy.output.name, (1,)),))


# ------------------------------------------------------------------ partial max and min inputs

@pytest.mark.parametrize("op", ["max", "min"])
def test_extremum_pieces_reduce_to_the_value_with_one_holder_and_no_near_tie(op):
    value = torch.randn(5, 6, dtype=torch.float64)
    pieces = partial_pieces(value, 3, seed=2, op=op)
    assert torch.equal(pieces.amax(0) if op == "max" else pieces.amin(0), value)
    assert torch.equal(pieces, partial_pieces(value, 3, seed=2, op=op))
    holders = (pieces == value).sum(0)
    assert torch.equal(holders, torch.ones_like(holders))                # exactly one rank holds each element
    gaps = (pieces - value).abs()[pieces != value]
    assert gaps.min() >= 0.1 * value.abs().mean()                          # no two pieces near a tie
    assert len({int(h) for h in (pieces == value).int().argmax(0).flatten()}) == 3   # every rank holds some


@pytest.mark.parametrize("op", ["max", "min"])
def test_a_blocks_extremum_pieces_are_its_slice_of_the_whole_tensors_pieces(op):
    """What every layout of a case reads: the whole tensor's max or min pieces, sliced to a block,
    reduce to the block, one piece holds each element, and the far gaps pass the block's spread."""
    whole = torch.randn(6, 4, dtype=torch.float64) * torch.arange(1, 7, dtype=torch.float64)[:, None]
    pieces, block = partial_pieces(whole, 2, seed=3, op=op)[:, 2:4], whole[2:4]
    assert torch.equal(pieces.amax(0) if op == "max" else pieces.amin(0), block)
    holders = (pieces == block).sum(0)
    assert torch.equal(holders, torch.ones_like(holders))
    gaps = (pieces - block).abs()[pieces != block]
    assert gaps.min() >= 0.1 * whole.abs().mean() and gaps.max() > block.max() - block.min()


TANH = OpCase(op="tanh", target="torch.tanh", inputs=(InputDecl("x", (6, 5)),))


@pytest.mark.parametrize("mesh_shape", [(2, 2), (3,), (2, 3)])
def test_a_monotone_op_takes_a_partial_max_or_min_and_each_rank_gets_the_gradient_of_its_piece(mesh_shape):
    with handler("tanh_rule", torch.tanh, [IN0, OUT], {"pointwise": True, "monotone_in": ["input"]}):
        offered = strategies(TANH, mesh_shape, fresh=True)
        results = verify(TANH, mesh_shape, offered)
    extremum = [s for s in offered if s.partial_inputs]
    assert {p.op for s in extremum for p in s.partial_inputs} == {"max", "min"}
    assert all(r.passed for r in results), [r.report() for r in results if not r.passed]
    names = {s.name for s in extremum}
    assert "RR+Pmax0 -> RR | P0 max" in names and "RR+Pmin0 -> RR | P0 min" in names
    action = next(a for a in next(s for s in extremum if s.name == "RR+Pmax0 -> RR | P0 max").communication_actions)
    assert (action.pattern.name, action.where.name, action.op) == ("ALLREDUCE_FWD_IDENTITY_BWD", "AFTER", "max")


def test_add_takes_one_term_as_a_partial_max_and_the_other_terms_gradient_is_summed():
    case = OpCase(op="add", target="torch.add", inputs=(InputDecl("x", (4, 6)), InputDecl("y", (4, 6))))
    with handler("add_rule", torch.add, [IN0, IN1, OUT], {"pointwise": True, "monotone_in": ["input", "other"]}):
        offered = strategies(case, (2, 2), fresh=True)
        results = verify(case, (2, 2), offered)
    extremum = [s for s in offered if s.partial_inputs]
    assert extremum and all(len(s.partial_inputs) == 1 for s in extremum)
    assert all(r.passed for r in results), [r.report() for r in results if not r.passed]
    one = next(s for s in extremum if s.name == "RR+Pmax0 x RR -> RR | P0 max")
    assert [(a.operand, a.axes) for a in one.communication_actions if a.where.name == "BEFORE"] == [(one.inputs[1].name, (0,))]


@pytest.mark.parametrize("target,options", [
    (torch.sin, {"pointwise": True, "monotone_in": ["input"]}),      # sin is not monotone
    (torch.neg, {"pointwise": True, "monotone_in": ["input"]}),      # neg turns a max into a min
    (torch.tanh, {"pointwise": True, "monotone_in": ["-input"]}),    # tanh does not
], ids=["sin", "neg-as-increasing", "tanh-as-decreasing"])
def test_a_partial_max_to_an_op_not_monotone_that_way_is_caught_naming_strategy_and_tensor(target, options):
    case = OpCase(op=target.__name__, target=f"torch.{target.__name__}", inputs=(InputDecl("x", (4, 6)),))
    with handler("planted", target, [IN0, OUT], options):
        results = verify(case, (2, 2), strategies(case, (2, 2), fresh=True))
    failed = [r for r in results if not r.passed]
    extremum = [r for r in results if "+Pm" in r.strategy]
    assert extremum and {r.strategy for r in failed} == {r.strategy for r in extremum}
    assert "output" in failed[0].report() and failed[0].strategy in failed[0].report()


def test_a_partial_max_whose_gradient_reaches_every_rank_is_caught():
    """The gradient convention is checked: a piece's gradient lives where its rank holds the
    maximum, so an AFTER reduce whose backward hands every rank the whole gradient (a sum's)
    fails on the input's gradient, though its forward (an elementwise max) is right."""
    from shardverify.collectives import patterns

    with handler("tanh_rule", torch.tanh, [IN0, OUT], {"pointwise": True, "monotone_in": ["input"]}):
        chosen = [s for s in strategies(TANH, (2,), fresh=True) if s.name == "RR+Pmax0 -> RR | P0 max"]
        assert chosen
        real = patterns._ReducePartial.backward
        patterns._ReducePartial.backward = staticmethod(lambda ctx, *grads: (None, None, *grads))
        try:
            result, = verify(TANH, (2,), chosen)
        finally:
            patterns._ReducePartial.backward = real
    assert not result.passed and "grad of x" in {m.tensor for m in result.mismatches}
    assert "output" not in {m.tensor for m in result.mismatches}


def test_monotone_in_names_operands_and_directions_or_the_spec_is_refused():
    from shardverify.strategies.rules.sources import parse_rule

    rule = parse_rule({"pointwise": True, "monotone_in": ["input", "-other:max"]})
    assert rule.modifiers.monotone_in == (("input", "max", "max"), ("input", "min", "min"), ("other", "max", "min"))
    with pytest.raises(Exception, match="monotone_in.*'input:sum'"):
        parse_rule({"pointwise": True, "monotone_in": ["input:sum"]})
    with pytest.raises(Exception, match="monotone_in.*list of operand names"):
        parse_rule({"pointwise": True, "monotone_in": "input"})
