"""The rule notation and the one `rules` generator: parse/str round trip, binding errors, and
for each family a deliberately wrong rule that the numerical verification catches, naming the
strategy and the tensor."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

import shardverify.strategies.handlers.base as handlers
from shardverify.strategies.for_node import strategies_for_node
from shardverify.backends.simulated import SimulatedBackend
from shardverify.errors import InvalidArgument
from shardverify.strategies.handlers.base import HandlerDef, OperandDecl, ParamDecl, target_key
from shardverify.sharding.mesh import DeviceMesh
from shardverify.strategies.rules.notation import parse_equation
from shardverify.strategies.rules.rule import bind
from shardverify.strategies.rules.sources import parse_rule
from shardverify.spec.case import InputDecl, OpCase
from shardverify.verify.engine import verify_case


# ------------------------------------------------------------------------------ notation

@pytest.mark.parametrize("text", ["mk,kn->mn", "bmk,bkn->bmn", "...k, nk, n -> ...n", "n i h w, o i kh kw, o -> n o oh ow",
                                  "a (b c) -> a b c", "a 1 b -> a b", "mk,kn->mn,m"])
def test_equations_round_trip(text):
    eq = parse_equation(text)
    assert parse_equation(str(eq)) == eq


@pytest.mark.parametrize("text,fragment", [("mk,kn", "exactly one '->'"), ("mm,mn->mn", "appear twice"),
                                           ("m(k,kn->mn", "unclosed"), ("m-k->m", "not a factor name"),
                                           ("a ... ... -> a", "once per term")])
def test_bad_equations_name_the_problem(text, fragment):
    with pytest.raises(InvalidArgument, match=fragment.replace("(", r"\(")):
        parse_equation(text)


def test_binding_broadcasts_and_reduces():
    rule = bind(parse_equation("...k, nk, n -> ...n"), [(4, 4, 16), (32, 16), (32,)], [(4, 4, 32)], additive=[2])
    assert rule.size == {"_b0": 4, "_b1": 4, "k": 16, "n": 32}
    assert dict(rule.reduce) == {"k": "sum"} and rule.additive == (2,)
    broadcast = bind(parse_equation("a b, a b -> a b"), [(8, 16), (1, 16)], [(8, 16)])
    assert broadcast.inputs[1] == ((), ("b",))      # the size-1 dim holds no factor
    with pytest.raises(InvalidArgument, match="dim 0 of input 1 has size 8 and dim 1 of input 0 size 16, but the rule .* gives both the same dim 'k'"):
        bind(parse_equation("mk,kn->mn"), [(8, 16), (8, 8)], [(8, 8)])
    conv = bind(parse_equation("n i h w, o i kh kw -> n o oh ow"), [(2, 4, 8, 8), (6, 4, 3, 3)], [(2, 6, 6, 6)],
                whole=("h", "w", "kh", "kw"))
    assert {"oh", "ow"} <= conv.whole                 # only an output holds them


def test_rule_options_are_validated_eagerly():
    with pytest.raises(InvalidArgument, match="exactly one of"):
        parse_rule({"einsum": "mk,kn->mn", "pointwise": True})
    with pytest.raises(InvalidArgument, match="factor"):
        parse_rule({"einsum": "mk,kn->mn", "whole": ["q"]})
    with pytest.raises(InvalidArgument, match="reduce_op"):
        parse_rule({"reduce_dims_param": "dim", "reduce_op": "prod"})
    with pytest.raises(InvalidArgument, match="unknown rule option"):
        parse_rule({"pointwise": True, "wohle": ["x"]})


# ---------------------------------------------------------------- planted wrong rules

@contextlib.contextmanager
def handler(name: str, target, operands, options, params=()):
    """Register a handler for ``target`` in place of the shipped one, for one test."""
    defn = HandlerDef(name=name, targets=(target,), operands=tuple(operands), params=tuple(params),
                      generator="rules", rule=parse_rule(options))
    key = target_key(target)
    saved = handlers._REGISTRY.get(key)
    handlers._REGISTRY[key] = (defn,)
    try:
        yield defn
    finally:
        if saved is None:
            handlers._REGISTRY.pop(key, None)
        else:
            handlers._REGISTRY[key] = saved


IN0 = OperandDecl("input", "input", 0, "input")
IN1 = OperandDecl("other", "input", 1, "other")
OUT = OperandDecl("output", "output")


def failures(case: OpCase, mesh_shape=(2, 2)):
    backend = SimulatedBackend(DeviceMesh(mesh_shape))
    try:
        results = verify_case(backend, case)
    finally:
        backend.close()
    return [r for r in results if not r.passed], results


def test_a_sharded_softmax_dim_is_caught():
    case = OpCase(op="wrong_softmax", target="torch.softmax", inputs=(InputDecl("x", (8, 16)),), params=(("dim", 1),))
    with handler("wrong_softmax", torch.softmax, [IN0, OUT], {"pointwise": True},   # forgot whole_dims_param: dim
                 [ParamDecl("dim", 1, "dim")]):
        failed, results = failures(case)
    assert failed and len(results) > len(failed)
    # exactly the strategies that shard the softmax dim (dim 1 of the input) fail
    input_dims = {r.strategy: re.findall(r"R|S\d+", r.strategy.split(" -> ")[0]) for r in results}
    assert {r.strategy for r in failed} == {name for name, dims in input_dims.items() if dims[1] != "R"}
    report = failed[0].report()
    assert failed[0].strategy in report and "output" in report


def test_a_contraction_combined_with_the_wrong_op_is_caught():
    case = OpCase(op="wrong_mm", target="torch.mm", inputs=(InputDecl("a", (8, 16)), InputDecl("b", (16, 8))))
    with handler("wrong_mm", torch.mm, [IN0, OperandDecl("mat2", "input", 1, "mat2"), OUT],
                 {"einsum": "mk,kn->mn", "reduce": (("k", "max"),)}):
        failed, _ = failures(case)
    assert failed and all("| P" in r.strategy and "max" in r.strategy for r in failed)
    assert "output" in failed[0].report()


def test_a_contraction_without_its_all_reduce_is_caught():
    case = OpCase(op="mm", target="torch.mm", inputs=(InputDecl("a", (8, 16)), InputDecl("b", (16, 8))))
    with handler("mm_rule", torch.mm, [IN0, OperandDecl("mat2", "input", 1, "mat2"), OUT], {"einsum": "mk,kn->mn"}):
        graph_module, node = case.build()
        mesh = DeviceMesh((2, 2))
        partial = [s for s in strategies_for_node(graph_module, node, mesh) if "| P" in s.name]
        stripped = [s.replace(communication_actions=tuple(a for a in s.communication_actions
                                                          if a.where.name != "AFTER")) for s in partial]
        backend = SimulatedBackend(mesh)
        try:
            results = verify_case(backend, case, stripped)
        finally:
            backend.close()
    assert partial and all(not r.passed for r in results)


def test_a_broadcast_operand_given_the_wrong_dim_is_caught():
    # other (16,) broadcasts along x's LAST dim; the rule wrongly aligns it with the first. A
    # shard of `a` then gives y a local shape the op cannot broadcast: the strategy is refused
    # when its local call is sized up, naming the node and the local shapes.
    from shardverify.errors import StrategyError

    case = OpCase(op="wrong_add", target="torch.add", inputs=(InputDecl("x", (16, 16)), InputDecl("y", (16,))))
    with handler("wrong_add", torch.add, [IN0, IN1, OUT], {"einsum": "a b, a -> a b"}):
        graph_module, node = case.build()
        with pytest.raises(StrategyError, match=r"wrong_add \(its spec\): node 'add': the op raised when called on the block "
                                                r"shapes a layout of the rule gives one device, \{'x': \((8|4), 16\), 'y': \((8|4),\)"):
            strategies_for_node(graph_module, node, DeviceMesh((2, 2)))


def test_a_view_map_sending_a_shard_to_the_wrong_dim_is_caught():
    case = OpCase(op="wrong_transpose", target="torch.transpose", inputs=(InputDecl("x", (8, 8, 4)),),
                  params=(("dim0", 0), ("dim1", 1)))
    with handler("wrong_transpose", torch.transpose, [IN0, OUT], {"einsum": "a b c -> a b c"},   # identity map
                 [ParamDecl("dim0", 1, "dim0"), ParamDecl("dim1", 2, "dim1")]):
        failed, results = failures(case)
    assert failed and any(r.passed for r in results)      # shards of c still pass through correctly
    assert "output" in failed[0].report() and failed[0].strategy in failed[0].report()


def test_a_compound_dim_spreads_its_shard_only_while_each_rank_holds_one_block():
    """16 viewed as 2 x 8 on (2,2): the 2 over axis 0 and the 8 over axis 1 is S01 of the
    16, offered; the 8 sharded while the 2 is not (rank j: rows j*4..j*4+3 of both 8-row
    halves) is no block of the 16, never offered."""
    from shardverify.strategies.rules.derive import reshape
    from shardverify.strategies.rules.generator import assignments

    equation, whole, sizes = reshape((16,), (2, 8))
    rule = bind(equation, [(16,)], [(2, 8)], whole=tuple(whole), sizes=sizes)
    found = assignments(rule, (2, 2))
    assert {"g0_0": (0,), "g0_1": (1,)} in found and {"g0_0": (1,), "g0_1": (0,)} in found
    assert not any("g0_1" in axes and "g0_0" not in axes for axes in found)
    assert rule.contiguous({"g0_0": 2, "g0_1": 4}) and not rule.contiguous({"g0_1": 2})


def test_a_spread_that_leaves_a_rank_no_single_block_is_caught(monkeypatch):
    """Without the contiguity rule, a view offers the later part of a split dim sharded while
    the leading part is not: those layouts put different elements on a rank on each side,
    and the verifier fails exactly them."""
    from shardverify.strategies.rules.rule import Rule

    def check(op: str):
        case = OpCase(op=op, target="torch.reshape", inputs=(InputDecl("x", (8, 16)),), params=(("shape", (8, 2, 8)),))
        with handler(op, torch.reshape, [IN0, OUT], {"view": "reshape", "shape_param": "shape"}, RESHAPE_PARAMS):
            return failures(case)

    honest, offered = check("view_spread")
    monkeypatch.setattr(Rule, "contiguous", lambda self, ways: True)
    failed, results = check("view_spread_planted")
    assert not honest and failed and len(results) > len(failed) and len(offered) == len(results) - len(failed)
    # exactly the strategies with the 8 of the split (output dim 2) sharded and the 2 (dim 1) not
    out_dims = {r.strategy: re.findall(r"R|S\d+", r.strategy.split(" -> ")[1]) for r in results}
    assert {r.strategy for r in failed} == {name for name, dims in out_dims.items() if dims[2] != "R" and dims[1] == "R"}


def test_the_right_rules_pass_where_the_wrong_ones_fail():
    case = OpCase(op="transpose_rule", target="torch.transpose", inputs=(InputDecl("x", (8, 8, 4)),),
                  params=(("dim0", 0), ("dim1", 1)))
    with handler("transpose_rule", torch.transpose, [IN0, OUT],
                 {"view": "transpose", "dim0_param": "dim0", "dim1_param": "dim1"},
                 [ParamDecl("dim0", 1, "dim0"), ParamDecl("dim1", 2, "dim1")]):
        failed, results = failures(case)
    assert not failed and len(results) > 1


# ------------------------------------------- equations from the call, local shapes, masked ids

def test_torch_einsum_equations_read_like_torch():
    from shardverify.strategies.rules.notation import torch_einsum_equation

    assert torch_einsum_equation("bij, bjk -> bik") == parse_equation("bij,bjk->bik")
    assert torch_einsum_equation("ij,jk") == parse_equation("ij,jk->ik")         # implicit: letters used once
    assert torch_einsum_equation("...ij,...jk") == parse_equation("...ij,...jk->...ik")
    with pytest.raises(InvalidArgument, match="must be a string"):
        torch_einsum_equation(3)


EINSUM_OPERANDS = [OperandDecl("a", "input", 1), OperandDecl("b", "input", 2), OUT]


def einsum_case(equation: str, op: str = "einsum") -> OpCase:
    """A torch.einsum case; a distinct ``op`` gets its own traced graph (strategies are cached on it)."""
    from shardverify.spec.case import CallArg

    return OpCase(op=op, target="torch.einsum", inputs=(InputDecl("a", (4, 8, 8)), InputDecl("b", (4, 8, 8))),
                  positional=(CallArg("value", equation), CallArg("tensor", "a"), CallArg("tensor", "b")))


def test_an_einsum_read_from_the_call_is_verified_and_a_wrong_one_is_caught():
    right = einsum_case("bij,bjk->bik", op="einsum_rule")   # not the shipped spec's graph: its cache stays the spec's
    with handler("einsum_rule", torch.einsum, EINSUM_OPERANDS, {"einsum_param": "equation"}, [ParamDecl("equation", 0)]):
        failed, results = failures(right)
    assert not failed and any("| P" in r.strategy for r in results)
    # the same equation with its contraction combined by max instead of sum
    with handler("wrong_einsum", torch.einsum, EINSUM_OPERANDS, {"einsum_param": "equation", "reduce": {"j": "max"}},
                 [ParamDecl("equation", 0)]):
        failed, results = failures(einsum_case("bij,bjk->bik", op="wrong_einsum"))
    assert failed and {r.strategy for r in failed} == {r.strategy for r in results if "| P" in r.strategy}
    assert "output" in failed[0].report()


RESHAPE_PARAMS = [ParamDecl("shape", 1, "shape", varargs=True)]


def _the_true_local_shape_passes_a_reversed_one_fails(case, mesh, strategies, sharded) -> None:
    """Every strategy passes; each of ``sharded`` with its local shape argument reversed (the
    same element count, so the op runs) fails on its output."""
    from shardverify.sharding.strategy import LocalArg

    lying = [s.replace(local_args=(LocalArg(s.local_args[0].locator, tuple(reversed(s.local_args[0].value))),))
             for s in sharded]
    backend = SimulatedBackend(mesh)
    try:
        good, bad = verify_case(backend, case, strategies), verify_case(backend, case, lying)
    finally:
        backend.close()
    assert all(r.passed for r in good)
    assert all(not r.passed for r in bad) and "output" in bad[0].report()


def test_a_reshape_passes_each_ranks_local_shape_and_a_wrong_one_is_caught():
    case = OpCase(op="reshape", target="torch.reshape", inputs=(InputDecl("x", (8, 4, 16)),),
                  params=(("shape", (32, 16)),))
    with handler("reshape_rule", torch.reshape, [IN0, OUT], {"view": "reshape", "shape_param": "shape"},
                 RESHAPE_PARAMS):
        graph_module, node = case.build()
        mesh = DeviceMesh((2, 2))
        strategies = strategies_for_node(graph_module, node, mesh)
        sharded = [s for s in strategies if s.local_args and s.local_args[0].value != (32, 16)
                   and s.local_args[0].value[0] != s.local_args[0].value[1]]
        assert sharded and all(s.local_args[0].value == s.output_sharding_spec.local_shape() for s in strategies)
        # the same local element count in another shape: the op runs, the values land wrong
        _the_true_local_shape_passes_a_reversed_one_fails(case, mesh, strategies, sharded)


UNFLATTEN_PARAMS = [ParamDecl("dim", 1, "dim"), ParamDecl("sizes", 2, "sizes")]
UNFLATTEN_OPTIONS = {"view": "reshape", "shape_param": "sizes", "shape_dim_param": "dim"}


def test_an_unflatten_passes_each_ranks_local_sizes_and_a_wrong_one_is_caught():
    """torch.unflatten's sizes are the split dim's part of the output shape: each rank passes
    its local sizes of those output dims (dims 2 and 3 of 16 x 4 x 4 x 4 here)."""
    case = OpCase(op="unflatten", target="torch.unflatten", inputs=(InputDecl("x", (16, 4, 16)),),
                  params=(("dim", -1), ("sizes", (4, 4))))
    with handler("unflatten_rule", torch.unflatten, [IN0, OUT], UNFLATTEN_OPTIONS, UNFLATTEN_PARAMS):
        graph_module, node = case.build()
        mesh = DeviceMesh((2, 2))
        strategies = strategies_for_node(graph_module, node, mesh)
        assert all(s.local_args[0].value == s.output_sharding_spec.local_shape()[2:4] for s in strategies)
        sharded = [s for s in strategies if s.local_args[0].value[0] != s.local_args[0].value[1]]
        assert sharded
        # the same local element count split the other way: the op runs, the values land wrong
        _the_true_local_shape_passes_a_reversed_one_fails(case, mesh, strategies, sharded)


def test_the_split_dim_must_be_one_int_and_needs_the_sizes_param():
    from shardverify.errors import StrategyError

    with pytest.raises(InvalidArgument, match="'shape_dim_param' .* needs shape_param"):
        parse_rule({"view": "reshape", "shape_dim_param": "dim"})
    case = OpCase(op="unflatten_bad", target="torch.unflatten", inputs=(InputDecl("x", (16, 4, 16)),),
                  params=(("dim", -1), ("sizes", (4, 4))))
    options = {**UNFLATTEN_OPTIONS, "shape_dim_param": "sizes"}   # names the sizes, a tuple, as the dim
    with handler("unflatten_bad", torch.unflatten, [IN0, OUT], options, UNFLATTEN_PARAMS):
        graph_module, node = case.build()
        with pytest.raises(StrategyError, match=r"unflatten_bad: node .*: call parameter 'sizes' must be one dim "
                                                r"\(an int\), got \(4, 4\)"):
            strategies_for_node(graph_module, node, DeviceMesh((2,)))


def test_a_reshape_without_local_shapes_offers_only_what_the_global_shape_allows():
    case = OpCase(op="reshape_global", target="torch.reshape", inputs=(InputDecl("x", (8, 4, 16)),),
                  params=(("shape", (32, 16)),))
    with handler("reshape_global", torch.reshape, [IN0, OUT], {"view": "reshape"}, RESHAPE_PARAMS):
        graph_module, node = case.build()
        names = [s.name for s in strategies_for_node(graph_module, node, DeviceMesh((2, 2)))]
    assert names == ["RRR -> RR"]      # every shard breaks the global shape: never offered, never wrong


EMBEDDING_OPERANDS = [OperandDecl("input", "input", 0, "input"), OperandDecl("weight", "param", 1, "weight"), OUT]


def embedding_case(op: str = "embedding") -> OpCase:
    return OpCase(op=op, target="torch.nn.functional.embedding",
                  inputs=(InputDecl("input", (8, 8), "int64"), InputDecl("weight", (16, 16))))


def test_vocab_parallel_embedding_masks_ids_and_without_indices_it_is_caught():
    case = embedding_case()
    target = torch.nn.functional.embedding
    with handler("embedding_rule", target, EMBEDDING_OPERANDS, {"einsum": "b s, v e -> b s e", "indices": {"input": "v"}}):
        failed, results = failures(case)
    vocab = [r for r in results if r.strategy.split(" x ")[1].startswith("S")]
    assert not failed and vocab and all("| P" in r.strategy for r in vocab)
    # the same rule without `indices`: v is a plain contraction, the ranks look up global ids
    # in their local rows, and every vocab-parallel strategy fails
    with handler("wrong_embedding", target, EMBEDDING_OPERANDS, {"einsum": "b s, v e -> b s e"}):
        failed, results = failures(embedding_case("wrong_embedding"))
    assert failed and {r.strategy for r in failed} == {r.strategy for r in results
                                                       if r.strategy.split(" x ")[1].startswith("S")}
    assert "rank" in failed[0].report()


def test_an_index_shard_that_disagrees_with_the_table_layout_cannot_run():
    from shardverify.sharding.partial import IndexShard

    case = embedding_case("embedding_index_shard")
    with handler("embedding_rule", torch.nn.functional.embedding, EMBEDDING_OPERANDS,
                 {"einsum": "b s, v e -> b s e", "indices": {"input": "v"}}):
        graph_module, node = case.build()
        mesh = DeviceMesh((2, 2))
        strategy = next(s for s in strategies_for_node(graph_module, node, mesh) if s.index_shards)
        shard = strategy.index_shards[0]
        wrong = strategy.replace(index_shards=(IndexShard(shard.index, shard.table, shard.dim,
                                                          tuple(1 - a for a in shard.axes)),))
        backend = SimulatedBackend(mesh)
        try:
            (result,) = verify_case(backend, case, [wrong])
        finally:
            backend.close()
    assert not result.passed and "index shard" in result.report()
