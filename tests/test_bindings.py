"""A rule serves only the calls it was verified on: a parameter value outside the verified ones,
or an argument the spec does not declare, is refused with its name, and the node falls back
loudly; two rules of one target bound to disjoint values each serve their own calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardverify.strategies.rules.sources import parse_rule
from shardverify import DeviceMesh, strategies_for_node, trace
from shardverify.capture.export import annotate
from shardverify.errors import HandlerError
from shardverify.plan.coverage import classify_nodes
from shardverify.spec.case import InputDecl
from shardverify.strategies.handlers.base import HandlerDef, OperandDecl, ParamDecl
from shardverify.strategies.handlers.serving import handler_for_node, outside_grid

MESH = DeviceMesh((2, 2))


class Fn(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class Fn2(Fn):
    def forward(self, x, y):
        return self.fn(x, y)


def _node(fn, *shapes, dtypes=None):
    names = ["x", "y"][:len(shapes)]
    dtypes = dtypes or [torch.float32] * len(shapes)
    graph_module = trace((Fn if len(shapes) == 1 else Fn2)(fn), {n: torch.empty(s, dtype=d) for n, s, d in zip(names, shapes, dtypes)})
    node = next(n for n in graph_module.graph.nodes if n.op in ("call_function", "call_method"))
    return graph_module, node


def test_a_parameter_value_outside_the_grid_is_refused_naming_it():
    # index_select's rules are written for dim 0 and dim 1 (index_select_dim1.yaml): dim=2 is neither
    graph_module, node = _node(lambda t, i: torch.index_select(t, 2, i), (4, 8, 5), (3,),
                               dtypes=[torch.float32, torch.int64])
    with pytest.raises(HandlerError, match=r"passes dim=2; the rule was verified for dim in \{0\} only"):
        strategies_for_node(graph_module, node.name, MESH)
    ok_module, ok_node = _node(lambda t, i: torch.index_select(t, 0, i), (8, 4), (3,),
                               dtypes=[torch.float32, torch.int64])
    assert len(strategies_for_node(ok_module, ok_node.name, MESH)) > 1


def test_an_undeclared_keyword_is_refused_and_counted_as_a_fallback():
    # causal attention is another rule: the spec does not declare is_causal, so it is not served
    def attention(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    graph_module, node = _node(attention, (2, 2, 8, 4))
    with pytest.raises(HandlerError, match="is_causal=True, which specs/scaled_dot_product_attention.yaml "
                                           "does not declare"):
        strategies_for_node(graph_module, node.name, MESH)
    _, statuses = classify_nodes(graph_module, MESH)
    (status,) = [s for s in statuses if s.node == node.name]
    assert status.status == "refused" and "is_causal" in status.reason


def test_a_planted_rule_verified_on_one_value_is_not_served_another():
    # triu written as pointwise and verified on diagonal=-8 (the identity on 8x8): wrong elsewhere
    triu = HandlerDef(name="triu_pointwise", targets=(torch.triu,),
                      operands=(OperandDecl("input", "input", 0, "input"), OperandDecl("output", "output")),
                      params=(ParamDecl("diagonal", 1, "diagonal", 0),), generator="rules",
                      rule=parse_rule({"pointwise": True}), bindings=((torch.triu, (("diagonal", (-8,)),)),))
    graph_module, node = _node(lambda t: torch.triu(t, 1), (8, 8))
    assert "passes diagonal=1; the rule was verified for diagonal in {-8}" in outside_grid(triu, node, graph_module)
    graph_module, node = _node(lambda t: torch.triu(t, -8), (8, 8))
    assert outside_grid(triu, node, graph_module) is None


@pytest.mark.parametrize("training, handler", [(False, "batch_norm"), (True, "batch_norm_train")])
def test_two_rules_of_one_target_each_serve_their_own_calls(training, handler):
    def norm(x):
        c = x.shape[1]
        return torch.ops.aten.batch_norm.default(x, torch.ones(c), torch.zeros(c), torch.zeros(c), torch.ones(c),
                                                 training, 0.1, 1e-5, False)

    program = torch.export.export(Fn(norm), (torch.randn(8, 4, 6, 6),))
    graph_module = annotate(program.module())
    node = next(n for n in graph_module.graph.nodes if n.target is torch.ops.aten.batch_norm.default)
    assert handler_for_node(node, graph_module).name == handler
    names = [s.name for s in strategies_for_node(graph_module, node.name, MESH)]
    batch_sharded = [n for n in names if n.startswith("S")]
    assert bool(batch_sharded) is (not training)      # eval shards the batch, training never does


def test_input_value_ranges_are_validated():
    assert InputDecl("ids", (4,), "int64", values=(0, 16)).values == (0, 16)
    with pytest.raises(Exception, match="low < high"):
        InputDecl("x", (4,), values=(2.0, 1.0))
    with pytest.raises(Exception, match="integer bounds"):
        InputDecl("ids", (4,), "int64", values=(0, 2.5))



def test_strategies_of_a_copy_traced_for_other_shapes_are_its_own():
    """A deepcopy keeps node.meta, the strategies cache included: the cache is keyed by the shapes
    and dtypes, so the copy traced for another batch gets strategies of its own shapes."""
    import copy

    graph_module = trace(Fn(torch.nn.Linear(8, 8)), {"x": torch.empty(12, 8)})
    node = next(n for n in graph_module.graph.nodes if n.op == "call_module")
    before = strategies_for_node(graph_module, node.name, MESH)
    again = trace(copy.deepcopy(graph_module), {"x": torch.empty(4, 8, dtype=torch.float64)})
    after = strategies_for_node(again, node.name, MESH)
    shapes = {tuple(spec.tensor_shape) for s in after for _, spec in s.sharding_specs}
    assert (4, 8) in shapes and (12, 8) not in shapes
    assert {tuple(spec.tensor_shape) for s in before for _, spec in s.sharding_specs} >= {(12, 8)}


def test_gather_with_a_smaller_index_outside_the_gathered_dim_keeps_that_dim_whole():
    # the index's block of dim 0 would meet another block of the input: dim 0 is never cut
    graph_module, node = _node(lambda t, i: torch.gather(t, 1, i), (8, 6), (4, 6),
                               dtypes=[torch.float32, torch.int64])
    found = strategies_for_node(graph_module, node.name, MESH)
    assert found and not any("S" in s.name for s in found), [s.name for s in found]   # dim 1 is gathered: whole too
    graph_module, node = _node(lambda t, i: torch.gather(t, 1, i), (8, 6), (8, 3),
                               dtypes=[torch.float32, torch.int64])
    assert len(strategies_for_node(graph_module, node.name, MESH)) > 1


def test_the_vocab_parallel_rule_is_wrong_with_a_padding_row_so_it_is_bound_to_none():
    """Why embedding.yaml binds padding_idx to None: verified with a padding row, its vocab-parallel
    strategy fails (each rank zeroes the gradient of another row), and the padded calls go to
    embedding_padded.yaml, which keeps the vocab whole."""
    from pathlib import Path

    from shardverify.features.audit.run import offered_strategies
    from shardverify.backends import SimulatedBackend
    from shardverify.spec.loader import load_yaml_text
    from shardverify.spec.op import parse_op_spec
    from shardverify.verify.engine import verify_case

    text = (Path(__file__).parents[1] / "specs" / "embedding.yaml").read_text()
    text = text.split("  meshes:")[0] + "  grid:\n    padding_idx: [3]\n  meshes: [[4]]\n"
    spec = parse_op_spec(load_yaml_text(text, "embedding_padding_probe.yaml"))
    mesh = DeviceMesh((4,))
    (case_id, case), *_ = spec.op_cases()
    graph_module, name = case.build()
    node = next(n for n in graph_module.graph.nodes if n.name == name)
    _, strategies = offered_strategies(spec, graph_module, node, mesh)
    failed = [r for r in verify_case(SimulatedBackend(mesh), case, strategies) if not r.passed]
    assert [str(r).splitlines()[0].split("'")[1] for r in failed] == ["RR x S0R -> RRR | P0 sum"], case_id
    graph_module, node = _node(lambda ids: F.embedding(ids, torch.ones(16, 4), padding_idx=3), (8, 8),
                               dtypes=[torch.int64])
    assert handler_for_node(node, graph_module).name == "embedding_padded"


WRONG_RULES = {
    # triu as pointwise: the identity on 8x8 at diagonal=-8, wrong at any diagonal that cuts the matrix
    "triu": """\
op: triu_pointwise
description: triu written as pointwise.
targets: [torch.triu]
operands:
  input: {kind: input, index: 0, keyword: input}
  output: {kind: output}
params:
  diagonal: {index: 1, keyword: diagonal, default: 0}
generator: {family: rules, options: {pointwise: true}}
verify:
  inputs: {input: {shape: [8, 8]}}
  grid: {diagonal: [%s]}
  meshes: [[2]]
""",
    # vector_norm with a partial sum: right for ord=1 (a sum of |x|), wrong for the default ord=2
    "vector_norm": """\
op: norm_partial_sum
description: vector_norm with a partial sum over a sharded reduced dim.
targets: [torch.linalg.vector_norm]
operands:
  input: {kind: input, index: 0, keyword: x}
  output: {kind: output}
params:
  ord: {index: 1, keyword: ord, default: 2}
  dim: {index: 2, keyword: dim, default: null}
  keepdim: {index: 3, keyword: keepdim, default: false}
ignores: [dtype]
generator: {family: rules, options: {reduce_dims_param: dim, keepdim_param: keepdim, reduce_op: sum}}
verify:
  inputs: {input: {shape: [8, 8]}}
  grid: {ord: [%s], dim: [-1]}
  meshes: [[2]]
""",
}


def _verify_spec_text(text: str):
    """Every strategy the spec's rule offers for its first case on its first mesh, verified."""
    from shardverify.features.audit.run import offered_strategies
    from shardverify.backends import SimulatedBackend
    from shardverify.spec.loader import load_yaml_text
    from shardverify.spec.op import parse_op_spec
    from shardverify.verify.engine import verify_case

    spec = parse_op_spec(load_yaml_text(text, "planted.yaml"))
    mesh = DeviceMesh(spec.verify.meshes[0])
    (_, case), *_ = spec.op_cases()
    graph_module, name = case.build()
    node = next(n for n in graph_module.graph.nodes if n.name == name)
    _, strategies = offered_strategies(spec, graph_module, node, mesh)
    return spec, verify_case(SimulatedBackend(mesh), case, strategies)


@pytest.mark.parametrize("rule, verified, wrong, failing", [
    ("triu", "-8", "1", {"S0R -> S0R", "RS0 -> RS0"}),
    ("vector_norm", "1", "2", {"RS0 -> R | P0 sum"}),
])
def test_a_wrong_rule_passes_its_own_value_and_fails_the_next(rule, verified, wrong, failing):
    """The rule holds on the value it was verified on, so binding it to that value is what keeps
    it from other calls; verified on the value it is wrong for, it fails naming the strategy."""
    _, results = _verify_spec_text(WRONG_RULES[rule] % verified)
    assert all(r.passed for r in results)
    _, results = _verify_spec_text(WRONG_RULES[rule] % wrong)
    assert {r.strategy for r in results if not r.passed} == failing, [str(r) for r in results]


def test_a_pool_rule_bound_to_its_window_refuses_another():
    """A pooling rule that shards the rows is right only for windows inside a shard
    (kernel 2, stride 2); bound to that window, a MaxPool2d(3, stride=2, padding=1) is refused.
    (The shipped max_pool2d.yaml keeps the planes whole, right for every window.)"""
    pool = HandlerDef(name="pool_rows", targets=(F.max_pool2d,),
                      operands=(OperandDecl("input", "input", 0, "input"), OperandDecl("output", "output")),
                      params=(ParamDecl("kernel_size", 1, "kernel_size", None), ParamDecl("stride", 2, "stride", None),
                              ParamDecl("padding", 3, "padding", 0), ParamDecl("dilation", 4, "dilation", 1),
                              ParamDecl("ceil_mode", 5, "ceil_mode", False),
                              ParamDecl("return_indices", 6, "return_indices", False)),
                      generator="rules", rule=parse_rule({"pointwise": True}),
                      bindings=((F.max_pool2d, (("kernel_size", (2,)), ("stride", (2,)), ("padding", (0,)),
                                                ("dilation", (1,)), ("ceil_mode", (False,)),
                                                ("return_indices", (False,)))),))
    graph_module, node = _node(lambda t: F.max_pool2d(t, 3, stride=2, padding=1), (2, 2, 8, 8))
    assert "kernel_size=3; the rule was verified for kernel_size in {2}" in outside_grid(pool, node, graph_module)
    graph_module, node = _node(lambda t: F.max_pool2d(t, 2, stride=2), (2, 2, 8, 8))
    assert outside_grid(pool, node, graph_module) is None


class _Wrap(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.m = module

    def forward(self, x, y=None):
        return self.m(x) if y is None else self.m(x, y)


def _module_status(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor | None = None):
    graph_module = trace(_Wrap(module), {"x": x} if y is None else {"x": x, "y": y})
    _, statuses = classify_nodes(graph_module, MESH)
    (status,) = [s for s in statuses if s.node == "m"]
    return status


@pytest.mark.parametrize("module, attribute", [
    (torch.nn.Embedding(16, 8, max_norm=1.0), "max_norm=1.0"),
    (torch.nn.CrossEntropyLoss(ignore_index=0), "ignore_index=0"),
    (torch.nn.CrossEntropyLoss(label_smoothing=0.1), "label_smoothing=0.1"),
    (torch.nn.ReLU(inplace=True), "inplace=True"),
])
def test_a_module_whose_undeclared_attribute_changes_its_maths_is_refused(module, attribute):
    """A module target's constructor arguments count like a call's: one the spec neither
    declares nor ignores, set away from its default, is refused by name."""
    if isinstance(module, torch.nn.CrossEntropyLoss):
        status = _module_status(module, torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    elif isinstance(module, torch.nn.Embedding):
        status = _module_status(module, torch.zeros(4, 4, dtype=torch.long))
    else:
        status = _module_status(module, torch.zeros(4, 8))
    assert status.status == "refused" and f"attribute {attribute}" in status.reason, status


def test_attributes_the_spec_ignores_or_that_are_operands_are_served():
    """LayerNorm's eps is listed under `ignores`; a bias flag is the bias operand's business."""
    for module in (torch.nn.LayerNorm(8, eps=1e-6), torch.nn.Linear(8, 8, bias=False)):
        assert _module_status(module, torch.zeros(4, 8)).status == "handled"


def test_a_factory_reading_only_its_arguments_metadata_is_built_from_constants():
    """`mask.new_ones(...)` (HF's mask code) and `zeros_like` read their tensor's dtype, device
    and shape, never its values: their specs serve them; one their rule does not describe (a 0-d
    `new_ones` of a 2-d mask, OLMoE's and Mixtral's router) is built whole on every rank, the same
    everywhere; `empty_like` is not (its values are the memory's) and is never compared."""
    from shardverify.capture.export import export_graph

    class Masks(torch.nn.Module):
        def forward(self, x):
            return x.new_ones(()) + x.new_ones(4, 4) + torch.zeros_like(x) + torch.empty_like(x) * 0

    graph_module = export_graph(Masks(), (torch.randn(4, 4),))
    _, statuses = classify_nodes(graph_module, MESH)
    by_node = {s.node: s.status for s in statuses}
    by_target = {s.target: s.status for s in statuses}
    new_ones = sorted(by_node[s.node] for s in statuses if s.target == "aten.new_ones.default")
    assert new_ones == ["constant", "handled"] and by_target["aten.zeros_like.default"] == "handled", statuses
    assert by_target["aten.empty_like.default"] == "not compared"
