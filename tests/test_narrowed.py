"""An input holding a factor over a prefix of its mesh axes (strategies/rules/narrowed.py): the
audit decides such a combination valid (a one-element block broadcast against an empty one),
the rules generator offers it, and its gradient needs the all-reduce over the trailing axes."""

from __future__ import annotations

import torch

from shardverify.features.audit.decide import Operand, prepare
from shardverify.sharding.layout import Layout
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.strategy import CommPattern
from shardverify.spec.case import InputDecl, OpCase
from shardverify.strategies.rules.narrowed import single_elements
from test_rules import IN0, IN1, OUT, handler
from test_uneven import strategies, verify

# x [2, 3] * y [2, 1] on (2, 2): dim 0 (2 rows) cut over (0, 1) holds rows 0 and 1 on the ranks
# (0, 0) and (1, 0) and nothing on (0, 1) and (1, 1); over axis 0 alone, one row per rank
def _mul(x: tuple[int, ...], y: tuple[int, ...]) -> OpCase:
    return OpCase(op="mul", target="torch.mul", inputs=(InputDecl("x", x), InputDecl("y", y)))


MUL = _mul((2, 3), (2, 1))
NARROWED = "S0R x S01R -> S01R"


def test_one_element_blocks_are_found_on_every_rank():
    assert single_elements(2, (0,), (2, 2)) and single_elements(2, (0, 1), (2, 2))
    assert single_elements(4, (1, 2), (2, 2, 2)) and not single_elements(4, (1,), (2, 2, 2))
    assert single_elements(3, (1,), (2, 3)) and not single_elements(4, (1,), (2, 3))


def test_the_audit_finds_a_prefix_layout_valid_where_the_finer_cut_is_empty():
    problem = prepare(MUL, DeviceMesh((2, 2)), [Operand("x", "input", ("arg", 0), (2, 3), True),
                                                Operand("y", "other", ("arg", 1), (2, 1), True)])
    narrowed = (Layout(((0,), ())), Layout(((0, 1), ())))
    assert problem.decide(narrowed).outputs == (Layout(((0, 1), ())),)
    # the prefix's blocks must hold one element: two rows over one axis are no broadcast
    wide = prepare(_mul((4, 3), (4, 1)), DeviceMesh((2, 2)),
                   [Operand("x", "input", ("arg", 0), (4, 3), True), Operand("y", "other", ("arg", 1), (4, 1), True)])
    assert not wide.decide((Layout(((0,), ())), Layout(((0, 1), ())))).valid


def test_the_rules_offer_it_and_its_gradient_needs_the_trailing_all_reduce():
    with handler("mul_rule", torch.mul, [IN0, IN1, OUT], {"pointwise": True}):
        offered = {s.name: s for s in strategies(MUL, (2, 2), fresh=True)}
        assert NARROWED in offered and "S01R x S0R -> S01R" in offered, sorted(offered)
        strategy = offered[NARROWED]
        syncs = [a for a in strategy.communication_actions if a.pattern is CommPattern.IDENTITY_FWD_ALLREDUCE_BWD]
        assert [(a.operand, a.axes) for a in syncs] == [(strategy.sharding_specs[0][0], (1,))]
        results = verify(MUL, (2, 2), [strategy, strategy.replace(
            name=NARROWED + " (no gradient sync)",
            communication_actions=tuple(a for a in strategy.communication_actions if a not in syncs))])
    assert results[0].passed, results[0].report()
    # without it the ranks (i, 1) keep their zero gradient of x's row: the check fails
    assert not results[1].passed and "rank 1: grad of x" in results[1].report()
