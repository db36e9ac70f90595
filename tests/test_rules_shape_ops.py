"""Rule options for pads, scatters into a dim, diagonals and factories: each mechanism is
checked against a planted wrong rule that the verifier must catch, and where the right rule
passes."""

from __future__ import annotations

import re

import pytest
import torch

from shardverify.errors import InvalidArgument
from shardverify.spec.case import InputDecl, OpCase
from shardverify.strategies.handlers.base import OperandDecl, ParamDecl
from shardverify.strategies.rules.spec import RuleOptions, padded_dims
from tests.test_rules import IN0, OUT, failures, handler

PAD_PARAMS = [ParamDecl("pad", 1, "pad")]


def test_a_pad_list_names_the_dims_with_a_nonzero_pair_last_dim_first():
    assert padded_dims((1, 2), 3, "pad") == (2,)
    assert padded_dims((0, 0, 2, -1), 3, "pad") == (1,)           # (0, 0) leaves the last dim as it is
    assert padded_dims((1, -1, 0, 0, 1, 1), 3, "pad") == (2, 0)
    assert padded_dims(2, 3, "padding") == (2,)                   # nn.ReflectionPad1d(2)
    with pytest.raises(InvalidArgument, match="pad list"):
        padded_dims((1, 2, 3), 3, "pad")


def _pad_case(op: str, pad) -> OpCase:
    return OpCase(op=op, target="torch.constant_pad_nd", inputs=(InputDecl("x", (8, 8)),), params=(("pad", pad),))


@pytest.mark.parametrize("pad", [(1, -1), (0, 0, 1, 2)])
def test_a_pad_rule_keeps_the_padded_dims_whole_and_without_it_is_caught(pad):
    """(1, -1) keeps the last dim's size and shifts it: only the padded-dims option keeps it
    whole. A plain pointwise rule shards it, and exactly those strategies fail."""
    with handler("pad_rule", torch.constant_pad_nd, [IN0, OUT], {"pointwise": True, "whole_padded_param": "pad"},
                 PAD_PARAMS):
        failed, results = failures(_pad_case("pad_rule", pad), (4,))
    assert not failed and any("S0" in r.strategy for r in results)
    with handler("pad_wrong", torch.constant_pad_nd, [IN0, OUT], {"pointwise": True}, PAD_PARAMS):
        failed, results = failures(_pad_case("pad_wrong", pad), (4,))
    dims = {r.strategy: re.findall(r"R|S\d+", r.strategy.split(" -> ")[0]) for r in results}
    if pad == (1, -1):
        assert failed and {r.strategy for r in failed} == {n for n, d in dims.items() if d[1] != "R"}
    else:   # (0, 0, 1, 2) pads dim 0: the sizes differ, so the plain rule keeps it whole already
        assert not failed and all(d[0] == "R" for d in dims.values()) and any(d[1] != "R" for d in dims.values())


SCATTER_OPERANDS = [IN0, OperandDecl("src", "input", 1, "src"), OUT]
SCATTER_PARAMS = [ParamDecl("dim", 2, "dim"), ParamDecl("index", 3, "index")]


def _scatter_case(op: str) -> OpCase:
    return OpCase(op=op, target="torch.select_scatter", inputs=(InputDecl("x", (8, 4, 6)), InputDecl("src", (8, 6))),
                  params=(("dim", 1), ("index", -1)))


def test_an_operand_lacking_the_scattered_dim_takes_the_shards_of_the_others():
    """select_scatter's src is the input without `dim`: aligned as if it held it, src takes the
    input's shard of dim 0 and of dim 2 (without the option it would align from the right and
    never share dim 0); a rule that lets `dim` shard is caught, exactly there."""
    options = {"pointwise": True, "lacks_dims_param": "dim", "lacking_operands": ("src",), "whole_dims_param": "dim"}
    with handler("scatter_rule", torch.select_scatter, SCATTER_OPERANDS, options, SCATTER_PARAMS):
        failed, results = failures(_scatter_case("scatter_rule"), (4,))
    assert not failed and {"S0RR x S0R -> S0RR", "RRS0 x RS0 -> RRS0"} <= {r.strategy for r in results}
    options.pop("whole_dims_param")
    with handler("scatter_wrong", torch.select_scatter, SCATTER_OPERANDS, options, SCATTER_PARAMS):
        failed, results = failures(_scatter_case("scatter_wrong"), (4,))
    sharded = {r.strategy for r in results if re.findall(r"R|S\d+", r.strategy.split(" x ")[0])[1] != "R"}
    assert failed and {r.strategy for r in failed} == sharded
    with pytest.raises(InvalidArgument, match="go together"):
        RuleOptions.from_options({"pointwise": True, "lacks_dims_param": "dim"})


def _diagonal_case(op: str) -> OpCase:
    return OpCase(op=op, target="torch.diagonal", inputs=(InputDecl("x", (8, 4, 8)),),
                  params=(("offset", 0), ("dim1", 0), ("dim2", 2)))


DIAGONAL_PARAMS = [ParamDecl("offset", 1, "offset"), ParamDecl("dim1", 2, "dim1"), ParamDecl("dim2", 3, "dim2")]


def test_a_reduction_over_two_dims_appends_a_dim_only_the_output_holds():
    """torch.diagonal: dims 0 and 2 leave, the diagonal is appended (whole); the middle dim
    passes its shard. Combined as a sum instead (a partial diagonal per rank) is caught."""
    options = {"reduce_dims_param": ("dim1", "dim2"), "reduce_op": None}
    with handler("diagonal_rule", torch.diagonal, [IN0, OUT], options, DIAGONAL_PARAMS):
        failed, results = failures(_diagonal_case("diagonal_rule"), (4,))
    assert not failed and {r.strategy for r in results} == {"RS0R -> S0R", "RRR -> RR"}
    with handler("diagonal_wrong", torch.diagonal, [IN0, OUT], options | {"reduce_op": "sum"}, DIAGONAL_PARAMS):
        failed, results = failures(_diagonal_case("diagonal_wrong"), (4,))
    assert failed and all("| P0 sum" in r.strategy for r in failed)
