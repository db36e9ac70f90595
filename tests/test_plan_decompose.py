"""A node of an exported graph that no spec serves is decomposed with PyTorch's own decompositions
(that node only; an fx graph's torch-level call is traced to ATen ops as it is called), and its pieces are planned and verified like any other node; the report says
what was decomposed into what; a wrong strategy inside the pieces is caught naming the piece and
the node it came from; a node that cannot be decomposed keeps the fallback, said why."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from shardverify.capture.decompose import ORIGIN
from shardverify.plan import verify_plan
from shardverify.plan.recipe import ModelRecipe, traced
from shardverify.plan.verify import run_plan
from shardverify.sharding.sharding_spec import ShardingSpec

MESH = (2, 2)


class Gated(nn.Module):
    """``torch.addcmul`` (no spec serves it) between two projections and one after."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = self.up(x)
        return self.down(torch.addcmul(h, h, self.gate(x)))


def _checked(**goals):
    torch.manual_seed(0)
    return verify_plan(Gated(), torch.randn(8, 8), MESH, capture="export", verified_only=True, **goals)


def test_a_node_without_a_spec_is_decomposed_and_its_pieces_verified():
    result = _checked(data_parallel=True, strict=True)
    assert result.passed, result.summary()
    coverage = result.coverage
    pieces = Counter({"aten.mul.Tensor": 2, "aten.add.Tensor": 1})
    assert coverage.decompositions() == {("addcmul", "aten.addcmul.default"): pieces}
    assert coverage.count("unhandled") == 0 and coverage.count("refused") == 0
    # the pieces are sharded by the plan, not run replicated
    decomposed = [s.node for s in coverage.statuses if s.origin is not None]
    assert set(decomposed) <= set(coverage.sharded), (decomposed, coverage.sharded)
    text = "\n".join(coverage.lines())
    assert "decomposed: 1 node(s) into 3 node(s)" in text, text
    assert "'addcmul' aten.addcmul.default -> 3 nodes: aten.mul.Tensor x2, aten.add.Tensor x1" in text, text
    assert "1 node(s) decomposed" in coverage.headline()
    (entry,) = coverage.to_json()["decomposed"]
    assert entry == {"node": "addcmul", "target": "aten.addcmul.default", "nodes": 3, "into": dict(pieces)}


def test_the_pieces_are_marked_with_the_node_they_came_from():
    torch.manual_seed(0)
    graph = traced(ModelRecipe(Gated(), (torch.randn(8, 8),), capture="export"))
    marked = {n.name: n.meta[ORIGIN] for n in graph.graph.nodes if ORIGIN in n.meta}
    assert len(marked) == 3 and set(marked.values()) == {("addcmul", "aten.addcmul.default")}
    assert all(name.startswith("addcmul_") for name in marked)
    assert "addcmul" not in {n.name for n in graph.graph.nodes}      # the node itself is gone


def test_a_wrong_strategy_inside_a_decomposition_is_caught_and_named(sv_backend):
    """The planted bug: a piece's output declared S10 (shard order (1, 0)) where it computes S01:
    ranks 1 and 2 hold each other's rows. The check names the piece and the node it came from."""
    result = _checked(data_parallel=True)
    piece = next(s.node for s in result.coverage.statuses if s.origin is not None and s.target == "aten.add.Tensor")
    item = result.plan.node(piece)
    name, spec = item.strategy.sharding_specs[-1]
    assert str(spec) == "[S01, R]", item.strategy
    wrong = ShardingSpec.parse("[S10, R]", spec.tensor_shape, MESH)
    planted = item.strategy.replace(sharding_specs=(*item.strategy.sharding_specs[:-1], (name, wrong)))
    torch.manual_seed(0)
    checked = run_plan(sv_backend(MESH, "simulated"), Gated(), (torch.randn(8, 8),),
                       result.plan.replace_node(piece, strategy=planted), capture="export", coverage=result.coverage)
    assert not checked.passed
    first = checked.first_divergence()
    assert first.node == piece and first.phase == "forward", checked.summary()
    assert f"node {piece!r} (decomposed from 'addcmul': aten.addcmul.default)" in checked.summary()
    assert checked.to_json()["first_divergence"]["decomposed_from"] == ["addcmul", "aten.addcmul.default"]


class Undecomposable(nn.Module):
    def forward(self, x):
        return torch.poisson(x.abs()).sum(dim=-1)      # no spec, and PyTorch has no decomposition of it


def test_a_node_that_cannot_be_decomposed_keeps_the_fallback_and_says_why():
    result = verify_plan(Undecomposable(), torch.randn(8, 4), MESH, capture="export", verified_only=True)
    assert result.passed, result.summary()
    coverage = result.coverage
    assert coverage.unhandled_targets() == Counter({"aten.poisson.default": 1})
    assert not coverage.decompositions()
    text = "\n".join(coverage.lines())
    assert "not decomposed: 1 op(s) no spec covers: aten.poisson.default x1 " \
           "(PyTorch has no decomposition of it)" in text, text
    assert coverage.to_json()["not_decomposed"] == [
        {"node": "poisson", "target": "aten.poisson.default",
         "reason": "PyTorch has no decomposition of it"}]


def test_an_fx_graphs_torch_level_call_is_traced_to_aten_and_its_pieces_verified():
    """Under fx the node is ``torch.addcmul`` itself: traced at the ATen level as it is called, its
    pieces planned and verified like the export graph's."""
    torch.manual_seed(0)
    result = verify_plan(Gated(), torch.randn(8, 8), MESH, capture="fx", verified_only=True, data_parallel=True,
                         strict=True)
    assert result.passed, result.summary()
    coverage = result.coverage
    assert coverage.decompositions() == {("addcmul", "torch.addcmul"):
                                         Counter({"aten.mul.Tensor": 2, "aten.add.Tensor": 1})}
    assert coverage.count("unhandled") == 0


class Method(nn.Module):
    def forward(self, x):
        return x.deg2rad().sum(dim=-1)      # a tensor method no spec serves


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, 4, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0].sum(dim=-1)


def test_an_fx_method_call_is_decomposed_and_a_modules_call_says_to_capture_with_export():
    torch.manual_seed(0)
    result = verify_plan(Method(), torch.randn(8, 4), MESH, capture="fx", verified_only=True)
    assert result.passed and result.coverage.count("unhandled") == 0, result.summary()
    assert result.coverage.decompositions() == {("deg2rad", "Tensor.deg2rad"): Counter({"aten.mul.Tensor": 1})}
    result = verify_plan(Recurrent(), torch.randn(8, 3, 4), MESH, capture="fx", verified_only=True)
    text = "\n".join(result.coverage.lines())
    assert "a module's or the user's own call, kept whole" in text, text


class LogSigmoid(nn.Module):
    def forward(self, x):
        return torch.nn.functional.logsigmoid(x).sum(dim=-1)


def test_a_piece_nothing_serves_is_decomposed_again():
    """``log_sigmoid`` decomposes into ``log_sigmoid_forward`` (no spec either), which decomposes
    into served pointwise ops; its named-tuple result is read as the values it holds."""
    from shardverify.plan.coverage import unserved

    graph = traced(ModelRecipe(LogSigmoid(), (torch.randn(4, 6),), capture="export"))
    pieces = [n for n in graph.graph.nodes if n.meta.get(ORIGIN) == ("log_sigmoid", "aten.log_sigmoid.default")]
    assert {"aten.exp.default", "aten.log1p.default"} <= {str(n.target) for n in pieces}, pieces
    assert not [n.name for n in pieces if unserved(n, graph)]
    assert not [n for n in graph.graph.nodes if "log_sigmoid" in str(n.target)]


class MaskedMean(nn.Module):
    """``torch.masked.mean`` branches on its mask in Python, which torch.fx cannot trace into."""

    def forward(self, x, mask):
        return torch.masked.mean(x, -1, mask=mask)


def test_a_torch_masked_call_under_fx_is_recorded_whole_then_traced_to_aten():
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    mask = torch.rand(8, 6) > 0.3
    result = verify_plan(MaskedMean(), (x, mask), MESH, capture="fx", data_parallel=True, strict=True)
    assert result.passed, result.summary()
    (root, pieces), = result.coverage.decompositions().items()
    assert root == ("mean", "torch.masked._ops.mean") and sum(pieces.values()) > 1, pieces


class SoftMargin(nn.Module):
    """A loss whose kernel takes no gradient through its target: traced with the target graded,
    the trace raises; the target is traced without a gradient and the loss decomposes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x, target):
        return torch.nn.functional.soft_margin_loss(self.proj(x), target)


def test_an_fx_loss_whose_target_takes_no_gradient_is_decomposed():
    torch.manual_seed(0)
    target = torch.randn(8, 4).sign()
    result = verify_plan(SoftMargin(), (torch.randn(8, 8), target), MESH, capture="fx", data_parallel=True, strict=True)
    assert result.passed, result.summary()
    (root, pieces), = result.coverage.decompositions().items()
    assert root == ("soft_margin_loss", "torch.nn.functional.soft_margin_loss") and pieces["aten.log1p.default"] == 1


class ChunkedLoss(nn.Module):
    """A settings object the forward builds from constants and hands the call: traced into the call."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Parameter(torch.randn(10, 8))

    def forward(self, x, target):
        from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

        options = LinearCrossEntropyOptions(batch_chunk_size=2)
        return torch.nn.functional.linear_cross_entropy(x, self.head, target, reduction="sum", options=options)


def test_a_call_taking_a_settings_object_built_in_the_graph_is_decomposed():
    torch.manual_seed(0)
    result = verify_plan(ChunkedLoss(), (torch.randn(6, 8), torch.randint(0, 10, (6,))), MESH, capture="fx")
    text = "\n".join(result.coverage.lines())
    assert "cannot be spliced" not in text and result.passed, text
    (root, pieces), = result.coverage.decompositions().items()
    assert root == ("linear_cross_entropy", "torch.nn.functional.linear_cross_entropy"), root
