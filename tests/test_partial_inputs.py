"""Partial inputs: an op linear in an operand takes it as a partial sum (``linear_in``), the
verifier builds it from real random pieces per rank, and a partial input passed to an op that
is not linear in it fails naming the strategy and the tensor."""

from __future__ import annotations

import pytest
import torch

from shardverify.errors import StrategyError
from shardverify.sharding.pieces import partial_pieces
from shardverify.sharding.strategy import PartialInput
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
