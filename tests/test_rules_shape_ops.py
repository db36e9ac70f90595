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
from shardverify.strategies.rules.spec import padded_dims
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
