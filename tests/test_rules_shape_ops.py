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
from shardverify.strategies.rules.sources import parse_rule
from shardverify.strategies.rules.sources.modifiers import padded_dims
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
        parse_rule({"pointwise": True, "lacks_dims_param": "dim"})


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


FULL_OUT = [OUT]
FULL_PARAMS = [ParamDecl("size", 0, "size"), ParamDecl("fill_value", 1, "fill_value")]


def _full_case(op: str) -> OpCase:
    return OpCase(op=op, target="torch.full", inputs=(), params=(("size", (7, 5)), ("fill_value", 1.5)))


def test_a_factory_makes_each_ranks_block_from_its_local_shape_and_the_global_one_is_caught(monkeypatch):
    """torch.full has no input: with ``factory`` every output dim shards, each rank passing its
    own block's shape (7 rows over 4 ranks: 2, 2, 2, 1); a rank passing the call's global shape
    would make the whole tensor: the layout check sees its local output is no block and offers
    none of the sharded strategies."""
    import shardverify.strategies.rules.generator as generator
    from shardverify.sharding.strategy import LocalArg

    options = {"pointwise": True, "factory": True, "shape_param": "size"}
    with handler("full_rule", torch.full, FULL_OUT, options, FULL_PARAMS):
        failed, results = failures(_full_case("full_rule"), (4,))
    assert not failed and {r.strategy for r in results} >= {"-> S0R", "-> RR"}
    monkeypatch.setattr(generator, "shape_argument", lambda ctx, at, out, part, uneven: LocalArg(at, tuple(out.tensor_shape)))
    with handler("full_wrong", torch.full, FULL_OUT, options, FULL_PARAMS):
        failed, results = failures(_full_case("full_wrong"), (4,))
    assert not failed and [r.strategy for r in results] == ["-> RR"]
    with pytest.raises(InvalidArgument, match="needs shape_param"):
        parse_rule({"pointwise": True, "factory": True})


def test_whole_tensors_offer_only_the_replicated_layout_and_the_partial_inputs_declared():
    """masked_scatter: nothing shards (the k-th true position takes source's k-th element), and
    input and source arrive as partial sums together; declared linear in input alone, the rule
    offers input partial with source whole, which the verifier catches."""
    operands = [IN0, OperandDecl("mask", "input", 1, "mask"), OperandDecl("source", "input", 2, "source"), OUT]
    case = OpCase(op="ms_rule", target="torch.masked_scatter", inputs=(
        InputDecl("x", (6, 5)), InputDecl("mask", (6, 5), "bool"), InputDecl("source", (7, 5))))
    options = {"whole_tensors": True, "linear_in": (("input", "source"),)}
    with handler("ms_rule", torch.masked_scatter, operands, options):
        failed, results = failures(case, (4,))
    assert not failed and {r.strategy for r in results} == {"RR x RR x RR -> RR", "RR+P0 x RR x RR+P0 -> RR | P0 sum"}
    with handler("ms_wrong", torch.masked_scatter, operands, options | {"linear_in": ("input",)}):
        failed, results = failures(OpCase(op="ms_wrong", target=case.target, inputs=case.inputs), (4,))
    assert [r.strategy for r in failed] == ["RR+P0 x RR x RR -> RR | P0 sum"]


ARANGE_PARAMS = [ParamDecl("start", 0, "start"), ParamDecl("end", 1, "end"), ParamDecl("step", 2, "step", default=1)]


@pytest.mark.parametrize("start", [-3, 0.5])
def test_a_range_factory_offsets_each_ranks_start_and_end_and_a_shifted_range_is_caught(monkeypatch, start):
    """aten.arange.start_step(start, 11, 2) over 4 ranks: each rank makes its own numbers; ranks
    given each block's range one step late (the right sizes, the wrong numbers) all fail."""
    import dataclasses

    import shardverify.strategies.rules.generator as generator

    target = torch.ops.aten.arange.start_step
    case = OpCase(op="arange_rule", target="torch.ops.aten.arange.start_step", inputs=(),
                  params=(("start", start), ("end", 11), ("step", 2)))
    options = {"pointwise": True, "factory": True, "range_params": ("start", "end", "step")}
    with handler("arange_rule", target, FULL_OUT, options, ARANGE_PARAMS):
        failed, results = failures(case, (4,))
    assert not failed and [r.strategy for r in results] == ["-> S0", "-> R"]
    right = generator.range_arguments

    def late(ctx, names, out):
        return tuple(dataclasses.replace(a, value=a.value + 2, per_rank=tuple(v + 2 for v in a.per_rank))
                     for a in right(ctx, names, out))

    monkeypatch.setattr(generator, "range_arguments", late)
    with handler("arange_wrong", target, FULL_OUT, options, ARANGE_PARAMS):
        failed, results = failures(dataclasses.replace(case, op="arange_wrong"), (4,))
    assert [r.strategy for r in failed] == ["-> S0"]
    with pytest.raises(InvalidArgument, match="needs factory"):
        parse_rule({"pointwise": True, "range_params": ["start", "end", "step"]})
