"""The rules engine's per-output and per-rank mechanisms: a factor some outputs hold reduced for
the others (``reduce_unheld``, ``reduce`` naming it), the default op of an einsum's reduced factors
(``reduce_op``), sizes each rank passes for its own blocks (``size_params``), and a layout whose
empty block gives another dtype; each with the planted wrong rule the verification catches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardverify.errors import InvalidArgument, StrategyError
from shardverify.spec.case import InputDecl, OpCase
from shardverify.strategies.for_node import strategies_for_node
from shardverify.strategies.handlers.base import OperandDecl, ParamDecl
from shardverify.strategies.rules.notation import parse_equation
from shardverify.strategies.rules.rule import bind
from shardverify.sharding.mesh import DeviceMesh
from tests.test_rules import failures, handler

aten = torch.ops.aten


def test_binding_reduces_output_held_factors_for_the_outputs_lacking_them():
    eq = parse_equation("... d, d -> ... d, d")
    rule = bind(eq, [(6, 4, 5), (5,)], [(6, 4, 5), (5,)], unheld_op="sum")
    assert dict(rule.unheld) == {"_b0": "sum", "_b1": "sum"} and rule.reduce == ()
    assert rule.output_partial({"_b0": (0,), "d": (1,)}, 0) == () and rule.output_partial({"_b0": (0,)}, 1) == (0,)
    named = bind(eq, [(6, 4, 5), (5,)], [(6, 4, 5), (5,)], reduce={"_b1": "sum"})
    assert dict(named.unheld) == {"_b1": "sum"}          # _b0: the second output does not depend on it
    assert bind(eq, [(6, 4, 5), (5,)], [(6, 4, 5), (5,)]).unheld == ()
    with pytest.raises(InvalidArgument, match="in every output"):
        bind(parse_equation("a b -> a b, a"), [(4, 4)], [(4, 4), (4,)], reduce={"a": "sum"})
    # a compound of two unknown factors, one seen only as a dim of one element: that one is 1
    one_group = bind(parse_equation("n (g k), (g k) -> n (g k), n g"), [(4, 6), (6,)], [(4, 6), (4, 1)])
    assert one_group.size == {"n": 4, "g": 1, "k": 6}
    # reduce_op: the default of a factor no output holds, the ellipsis's included
    mean = bind(parse_equation("... -> "), [(6, 4)], [()], default_op="avg")
    assert dict(mean.reduce) == {"_b0": "avg", "_b1": "avg"}
    assert bind(parse_equation("... -> "), [(6, 4)], [()], default_op=None).whole == {"_b0", "_b1"}


GN_BACKWARD = [OperandDecl("grad_out", "input", 0, "grad_out"), OperandDecl("input", "input", 1, "input"),
               OperandDecl("mean", "input", 2, "mean"), OperandDecl("rstd", "input", 3, "rstd"),
               OperandDecl("weight", "input", 4, "weight"), OperandDecl("grad_input", "output", index=0),
               OperandDecl("grad_weight", "output", index=1), OperandDecl("grad_bias", "output", index=2)]
GN_PARAMS = [ParamDecl("N", 5, "N"), ParamDecl("C", 6, "C"), ParamDecl("HxW", 7, "HxW"), ParamDecl("group", 8, "group"),
             ParamDecl("output_mask", 9, "output_mask")]
GN_OPTIONS = {"einsum": "n (g k) ..., n (g k) ..., n g, n g, (g k) -> n (g k) ..., (g k), (g k)",
              "whole": ("k", "..."), "reduce_unheld": "sum",
              "size_params": (("N", "n"), ("C", ("g", "k")), ("HxW", "..."), ("group", "g")),
              "constant_operands": ("grad_out", "input", "mean", "rstd", "weight")}
GN_CASE = OpCase(op="gn_backward", target="torch.ops.aten.native_group_norm_backward.default",
                 inputs=(InputDecl("grad_out", (4, 4, 3), grad=False), InputDecl("input", (4, 4, 3), grad=False),
                         InputDecl("mean", (4, 2), grad=False), InputDecl("rstd", (4, 2), values=(0.5, 2.0), grad=False),
                         InputDecl("weight", (4,), grad=False)),
                 params=(("N", 4), ("C", 4), ("HxW", 3), ("group", 2), ("output_mask", (True, True, True))))


def test_weight_gradients_of_a_batch_shard_are_partial_sums_and_without_it_the_check_fails():
    target = aten.native_group_norm_backward.default
    with handler("gn_backward", target, GN_BACKWARD, GN_OPTIONS, GN_PARAMS):
        graph_module, node = GN_CASE.build()
        names = [s.name for s in strategies_for_node(graph_module, node, DeviceMesh((2,)))]
        failed, results = failures(GN_CASE, (2,))
    assert not failed and "S0RR x S0RR x S0R x S0R x R -> S0RR, R+P0, R+P0 | P0 sum" in names
    assert "RS0R x RS0R x RS0 x RS0 x S0 -> RS0R, S0, S0" in names   # a group shard: nothing partial
    wrong = {k: v for k, v in GN_OPTIONS.items() if k != "reduce_unheld"}
    with handler("gn_backward_unreduced", target, GN_BACKWARD, wrong, GN_PARAMS):
        failed, _ = failures(dataclasses.replace(GN_CASE, op="gn_backward_unreduced"), (2,))
    assert [r.strategy for r in failed] == ["S0RR x S0RR x S0R x S0R x R -> S0RR, R, R"]
    assert "output 1" in failed[0].report()              # grad_weight


def test_each_rank_passes_its_own_blocks_sizes_and_without_them_the_op_refuses_the_blocks():
    target = aten.native_group_norm_backward.default
    with handler("gn_backward", target, GN_BACKWARD, GN_OPTIONS, GN_PARAMS):
        graph_module, node = GN_CASE.build()
        by_name = {s.name: s for s in strategies_for_node(graph_module, node, DeviceMesh((2,)))}
    batch, groups = by_name["S0RR x S0RR x S0R x S0R x R -> S0RR, R+P0, R+P0 | P0 sum"], \
        by_name["RS0R x RS0R x RS0 x RS0 x S0 -> RS0R, S0, S0"]
    # only the parameters whose factors the layout shards are replaced (the others keep the call's value)
    assert [a.value for a in batch.local_args] == [2] and [a.value for a in groups.local_args] == [2, 1]
    wrong = {k: v for k, v in GN_OPTIONS.items() if k != "size_params"}
    with handler("gn_backward_global_sizes", target, GN_BACKWARD, wrong, GN_PARAMS):
        case = dataclasses.replace(GN_CASE, op="gn_backward_global_sizes")
        graph_module, node = case.build()
        with pytest.raises(StrategyError, match="the op raised when called on the block shapes .* Expect input to have 48 elements"):
            strategies_for_node(graph_module, node, DeviceMesh((2,)))   # the global N with a rank's block


def test_a_layout_whose_empty_block_gives_another_dtype_is_not_offered():
    """native_dropout in eval gives a bool mask, but a float one for an input of no element: a
    dim of 6 over 4 ranks leaves the last rank an empty block, so that shard is not offered."""
    case = OpCase(op="dropout_rule", target="torch.ops.aten.native_dropout.default", inputs=(InputDecl("x", (4, 6)),),
                  params=(("p", 0.5), ("train", False)))
    operands = [OperandDecl("input", "input", 0, "input"), OperandDecl("output", "output", index=0),
                OperandDecl("mask", "output", index=1)]
    with handler("dropout_rule", aten.native_dropout.default, operands, {"pointwise": True},
                 [ParamDecl("p", 1, "p"), ParamDecl("train", 2, "train")]):
        graph_module, node = case.build()
        names = [s.name for s in strategies_for_node(graph_module, node, DeviceMesh((4,)))]
        failed, _ = failures(case, (4,))
    assert names == ["S0R -> S0R, S0R", "RR -> RR, RR"] and not failed


def test_an_empty_block_the_kernel_refuses_is_not_offered_though_its_decomposition_takes_it():
    """upsample_nearest3d's CPU kernel refuses an empty channel dim; under a dispatch mode (the
    flop counter) the op runs its Python decomposition, which takes it. The probe runs the
    kernel itself: 2 channels over 4 ranks are not offered, 4 are."""
    def names(channels: int) -> list[str]:
        case = OpCase(op="upsample_nearest3d", target="torch.ops.aten.upsample_nearest3d.vec",
                      inputs=(InputDecl("x", (2, channels, 5, 2, 3)),), params=(("output_size", (5, 6, 7)),
                                                                            ("scale_factors", None)))
        graph_module, node = case.build()
        return [s.name for s in strategies_for_node(graph_module, node, DeviceMesh((4,)))]
    assert "RS0RRR -> RS0RRR" not in names(2) and "RS0RRR -> RS0RRR" in names(4)
