"""Whole-model plans on both captures (torch.fx and torch.export): weights that reach their op
as graph values get the gradient reduction their strategy declares, integer inputs keep their
dtype, and the report counts what ran without strategies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardverify import DeviceMesh, verify_plan
from shardverify.capture.export import CaptureError, export_graph
from shardverify.errors import ShardVerifyError
from shardverify.plan.recipe import ModelRecipe, traced
from shardverify.plan.verify import plan_with_coverage

MESH = (4,)


class FunctionalBlock(torch.nn.Module):
    """Weights used through functional calls: get_attr nodes under fx, every weight under export."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(16, 8))
        self.ln_w = torch.nn.Parameter(torch.randn(16))
        self.ln_b = torch.nn.Parameter(torch.randn(16))

    def forward(self, x):
        return F.layer_norm(torch.relu(F.linear(x, self.w1)), (16,), self.ln_w, self.ln_b)


DATA_PARALLEL = {"linear": "S0R = S0R x RR_0", "relu": "S0R -> S0R", "layer_norm": "S0R x R x R -> S0R"}


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_data_parallel_reduces_the_gradients_of_graph_value_weights(capture):
    """Each rank sees a quarter of the batch: without the declared all-reduce of the weights'
    gradients (hooked on the local operand, as the get_attr weight has no module to hook), every
    weight gradient is a quarter of the truth."""
    result = verify_plan(FunctionalBlock(), torch.randn(8, 8), MESH, DATA_PARALLEL, capture=capture)
    assert result.passed, result.summary()
    assert set(result.coverage.sharded) == set(DATA_PARALLEL)


def test_a_dropped_gradient_reduction_is_caught(monkeypatch):
    """The planted bug: no HOOK on graph-value weights; the check names a weight's gradient."""
    from shardverify.plan import execute

    monkeypatch.setattr(execute, "apply_grad_hook", lambda comm, action, grad: grad)
    result = verify_plan(FunctionalBlock(), torch.randn(8, 8), MESH, DATA_PARALLEL, capture="export")
    assert not result.passed
    first = result.first_divergence()
    assert first.phase == "grad" and "grad of" in first.tensor and first.node in DATA_PARALLEL


class Lookup(torch.nn.Module):
    """Token ids in, as a language model starts."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, ids):
        return self.proj(self.embed(ids))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_integer_inputs_keep_their_dtype(capture):
    ids = torch.arange(16).reshape(2, 8) * 2 % 32      # every id below the table's 32 rows
    result = verify_plan(Lookup(), ids, MESH, capture=capture)
    assert result.passed, result.summary()
    assert result.coverage.count("handled") == 2


class Mixed(torch.nn.Module):
    def forward(self, x):
        y = torch.poisson(x.abs())               # no spec covers poisson, and PyTorch has no decomposition of it
        return torch.cat((y, y), dim=-1).mean(dim=-1)


class Computed(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x).sum(dim=x.dim() - 1)      # a dim computed in the graph: sum refuses it


def test_coverage_counts_and_names_what_falls_back():
    x = torch.randn(8, 4)
    plan, coverage = plan_with_coverage(Mixed(), (x,), MESH, capture="export")
    assert coverage.count("unhandled") == 1 and "aten.poisson.default" in coverage.unhandled_targets()
    assert "1 no spec covers" in coverage.headline() and coverage.count("refused") == 0
    plan, coverage = plan_with_coverage(Computed(), (x,), MESH, capture="fx")
    refused = [s for s in coverage.statuses if s.status == "refused"]
    assert [s.target for s in refused] == ["Tensor.sum"] and "computed in the graph" in refused[0].reason
    assert "1 refused" in coverage.headline()


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_one_value_in_two_operand_slots_is_two_operands(capture):
    """torch.cat((y, y)): each slot has its own layout and resharding; sharded, it verifies."""
    from shardverify.plan.coverage import classify_nodes

    x = torch.randn(8, 4)
    graph_module = traced(ModelRecipe(Mixed(), (x,), capture=capture))
    options, statuses = classify_nodes(graph_module, DeviceMesh(MESH))
    cat = next(s.node for s in statuses if "cat" in s.target)
    sharded = [s.name for s in options[cat] if "S0" in s.name]
    assert sharded, [s.name for s in options[cat]]
    result = verify_plan(Mixed(), x, MESH, {cat: sharded[0]}, capture=capture)
    assert result.passed and cat in result.coverage.sharded, result.summary()


def test_a_plan_that_shards_nothing_says_so():
    result = verify_plan(Mixed(), torch.randn(8, 4), MESH, capture="export")
    assert result.passed and result.shards_nothing
    assert "shards nothing" in result.summary()


def test_a_model_export_cannot_capture_is_a_capture_error():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            return x[x > 0].sum() if x.sum() > 0 else x.sum()   # control flow on values

    with pytest.raises(CaptureError, match="torch.export cannot capture DataDependent"):
        export_graph(DataDependent(), (torch.randn(4),), strict=True)


def test_unknown_capture_is_refused():
    with pytest.raises(Exception, match="capture must be one of"):
        ModelRecipe(Lookup(), (torch.zeros(2, 8, dtype=torch.long),), capture="jit")


@pytest.mark.parametrize("argv, message", [
    (["shardverify.plan.zoo.linear_chain", "--input", "8,32", "--mesh", "abc"], "got 'abc'"),
    (["shardverify.plan.zoo.linear_chain", "--input", "a,b"], "--input 'a,b': expected [NAME=][DTYPE][SHAPE]"),
    (["torch.nn.Linear", "--input", "4,4"], "TypeError: Linear.__init__() missing"),
    (["torch.nn.functional.relu", "--input", "4,4"], "defined in 'torch.nn.functional', outside the project"),
    # a wrong width names the input, its shape and what the first layer wanted
    (["shardverify.plan.zoo.linear_chain", "--input", "8,31"],
     "input 'x' (shape [8, 31], float32) does not fit LinearChain: its first layer 'fc1' (Linear, which wants "
     "shape [..., 32])"),
    (["shardverify.plan.zoo.linear_chain", "--input", "ids=int64[4,8]"], "an integer input needs its value range"),
])
def test_plan_command_input_errors_are_one_line_with_status_2(capsys, argv, message):
    from shardverify.cli.main import main

    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_plan_command_debug_shows_the_error_itself():
    from shardverify.cli.main import main

    with pytest.raises(ShardVerifyError, match="in_features") as info:   # the factory's own error is its cause
        main(["plan", "torch.nn.Linear", "--input", "4,4", "--debug"])
    assert isinstance(info.value.__cause__, TypeError) and "in_features" in str(info.value.__cause__)


def test_plan_command_passes_factory_keyword_arguments(capsys):
    from shardverify.cli.main import main

    assert main(["plan", "shardverify.plan.zoo.mlp_block", "--input", "8,32", "--mesh", "4",
                 "--kwarg", "d_hidden=128", "--json"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["cost"]["memory_bytes"] > 0
    # the keyword reaches the factory: one it does not take is the factory's TypeError, in one line
    assert main(["plan", "shardverify.plan.zoo.mlp_block", "--input", "8,32", "--kwarg", "nope=1"]) == 2
    assert "unexpected keyword argument 'nope'" in capsys.readouterr().err


def test_plan_report_says_why_a_node_has_no_strategy():
    from shardverify.plan.verify import describe_plan

    result = verify_plan(Mixed(), torch.randn(8, 4), MESH, capture="export")
    text = describe_plan(result.plan, result.coverage)
    assert "replicated: no spec covers aten.poisson.default" in text
    result = verify_plan(Computed(), torch.randn(8, 4), MESH, capture="fx")
    assert "replicated: Tensor.sum refused:" in describe_plan(result.plan, result.coverage)


class TiedHead(torch.nn.Module):
    """One weight used twice (GPT-2's embedding and LM head): its gradient is the sum of two
    contributions, each partial under data parallelism."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)

    def forward(self, ids):
        return F.linear(torch.tanh(self.embed(ids)), self.embed.weight)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_tied_weight_under_data_parallelism_reduces_each_use_once(capture):
    ids = torch.randint(0, 16, (8, 4), generator=torch.Generator().manual_seed(0))
    result = verify_plan(TiedHead(), (ids,), (4,), capture=capture, data_parallel=True)
    assert result.passed, result.summary()
    assert not result.shards_nothing


def test_an_op_that_raises_on_a_rank_is_reported_at_its_node_with_its_frames(monkeypatch):
    """A rank's exception names the node it ran, its step and strategy, and its last frames."""
    from shardverify.plan import execute

    real = execute.call_op

    def failing(node, module, values, **kwargs):
        if node.name == "tanh":
            raise RuntimeError("planted failure")
        return real(node, module, values, **kwargs)

    monkeypatch.setattr(execute, "call_op", failing)
    ids = torch.randint(0, 16, (8, 4), generator=torch.Generator().manual_seed(0))
    result = verify_plan(TiedHead(), (ids,), (2,), capture="fx")
    first = result.first_divergence()
    assert first is not None and first.phase == "error" and first.node == "tanh", result.summary()
    assert "planted failure" in first.tensor and "File " in first.tensor, first.tensor


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.scale


def _graph_with_an_unused_node() -> torch.fx.GraphModule:
    """A user's GraphModule holding an unused get_attr, which regenerating it from its code drops
    (and the used one is renamed): ViT's graph had such nodes."""
    graph_module = torch.fx.symbolic_trace(Scaled())
    with graph_module.graph.inserting_before(list(graph_module.graph.nodes)[1]):
        graph_module.graph.get_attr("scale")
    graph_module.recompile()
    return graph_module


def test_a_graph_module_reaches_a_worker_intact():
    import pickle

    graph_module = _graph_with_an_unused_node()
    recipe = ModelRecipe(graph_module, (torch.randn(4, 8),))
    shipped = pickle.loads(pickle.dumps(recipe))
    assert [n.name for n in shipped.module.graph.nodes] == [n.name for n in graph_module.graph.nodes]
    assert [name for name, _ in shipped.module.named_parameters()] == \
        [name for name, _ in graph_module.named_parameters()]


@pytest.mark.dist
def test_a_graph_module_with_an_unused_node_verifies_on_gloo(sv_backend):
    result = verify_plan(_graph_with_an_unused_node(), (torch.randn(4, 8),), (2,), backend=sv_backend((2,)),
                         min_sharded=1)
    assert result.passed, result.summary()


class OptionalMask(torch.nn.Module):
    """An optional input and a keyword default, written with Python operators."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, mask=None, scale: float = 2.0):
        y = self.lin(x)
        if mask is not None:
            y = y * mask
        return torch.relu(y) / scale + x


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["mask_left_none", "mask_given"])
def test_an_optional_input_left_none_or_given_verifies(capture, with_mask):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    inputs = (x, torch.randn(4, 8)) if with_mask else (x,)
    result = verify_plan(OptionalMask(), inputs, (2,), capture=capture, min_sharded=2)
    assert result.passed, result.summary()
    # `y * mask`, `/ scale` and `+ x` are served by the mul, div and add specs at both levels
    assert not result.coverage.fallbacks, result.coverage.lines()


@pytest.mark.parametrize("mesh", [(2, 2), (4,)], ids=["mesh2x2", "mesh4"])
def test_the_solver_shards_attention_and_mlp_of_a_transformer_encoder_layer(mesh):
    """torch's own nn.TransformerEncoderLayer as the root module, captured with torch.export: every
    op handled, and the solver's cheapest plan shards the attention and the feed-forward matmuls."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.0,
                                             batch_first=True).eval()
    result = verify_plan(layer, (torch.randn(4, 16, 64),), mesh, capture="export")
    assert result.passed, result.summary()
    assert not result.coverage.fallbacks, result.coverage.lines()
    targets = {s.node: s.target for s in result.coverage.statuses}
    sharded = {targets[node] for node in result.coverage.sharded}
    assert {"aten.scaled_dot_product_attention.default", "aten.linear.default"} <= sharded, sharded


def test_an_inplace_op_becomes_functional_only_where_nothing_observes_the_change():
    """`h += r` on a dead intermediate becomes aten.add; kept in place where a view of the value
    taken before would see the change."""
    class Residual(torch.nn.Module):
        def forward(self, x):
            h = torch.relu(x)
            h += x
            return torch.tanh(h)

    class Viewed(torch.nn.Module):
        def forward(self, x):
            h = torch.relu(x)
            v = h.view(-1)
            h += x
            return torch.tanh(h) + v.view(4, 8)

    def targets(model):
        graph = export_graph(model, (torch.randn(4, 8),)).graph
        return {str(n.target) for n in graph.nodes if n.op == "call_function"}

    assert "aten.add.Tensor" in targets(Residual()) and "aten.add_.Tensor" not in targets(Residual())
    assert "aten.add_.Tensor" in targets(Viewed())

    class Reshaped(torch.nn.Module):   # changes of shape only, on a view: no data another view sees
        def forward(self, x):
            return torch.relu(x).unsqueeze(0).transpose_(0, -1).squeeze_(-1)

    class ReadAgain(torch.nn.Module):   # the value is read again after its shape changed
        def forward(self, x):
            h = torch.relu(x).unsqueeze(0)
            t = h.transpose_(0, -1)
            return t.sum(0) + h.sum(0)

    found = targets(Reshaped())
    assert {"aten.transpose.int", "aten.squeeze.dim"} <= found and not {"aten.transpose_.default",
                                                                       "aten.squeeze_.dim"} & found, found
    x = torch.randn(4, 8)
    for model in (Reshaped(), ReadAgain()):
        out = export_graph(model, (x,))(x)
        assert torch.equal(out[0] if isinstance(out, (tuple, list)) else out, model(x))


class _Chain(torch.nn.Module):
    """Linear(6, 10) -> ReLU -> Linear(10, 5) on a batch of 7: on 3 ranks no size but 6 divides."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(6, 10), torch.nn.Linear(10, 5)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("goal", ["data_parallel", "shard_weights"])
def test_plans_take_strategies_that_cut_uneven_blocks_and_reshard_them(goal):
    """A batch of 7 and widths of 10 and 5 on 3 ranks, cut as DTensor cuts them (3, 3, 1; 4, 4, 2;
    2, 2, 1): the plans take such strategies, and the resharding between nodes moves blocks of
    unequal length (padded collectives), forward and backward."""
    from shardverify.plan.coverage import classify_nodes

    model, x = _Chain(), torch.randn(7, 6)
    graph_module = traced(ModelRecipe(model, (x,), capture="export"))
    options, _ = classify_nodes(graph_module, DeviceMesh((3,)))
    assert any(not spec.is_even for strategies in options.values() if strategies
               for s in strategies for _, spec in s.sharding_specs)
    result = verify_plan(model, x, (3,), capture="export", **{goal: True})
    assert result.passed, result.summary()
    uneven = [item.node for item in result.plan.nodes if item.strategy is not None
              and not all(spec.is_even for _, spec in item.strategy.sharding_specs)]
    assert uneven, [item.strategy_name for item in result.plan.nodes]


def test_an_off_by_one_block_boundary_in_uneven_resharding_is_caught(monkeypatch):
    """The planted bug: blocks of floor(n/k) (the remainder on the last rank) where DTensor cuts
    ceil(n/k) first: resharding hands ranks the wrong rows, and the plan check names a node."""
    from shardverify.collectives import reshard

    real = reshard.block_lengths

    def floor_blocks(comm, step, dim, prefix, group):
        lengths = real(comm, step, dim, prefix, group)
        total, k = sum(lengths), len(lengths)
        return [total // k] * (k - 1) + [total - (total // k) * (k - 1)]

    model, x = _Chain(), torch.randn(7, 6)
    assert verify_plan(model, x, (3,), capture="export", data_parallel=True).passed
    monkeypatch.setattr(reshard, "block_lengths", floor_blocks)
    result = verify_plan(model, x, (3,), capture="export", data_parallel=True)
    assert not result.passed and result.first_divergence() is not None, result.summary()


def test_chunk_pieces_become_their_slices_and_a_plan_serves_them():
    """export leaves ``x.chunk(3, 1)`` as ``aten.chunk`` and ``getitem`` nodes, which no rule serves;
    each piece becomes the slice it is (pieces of ceil(9 / 3) = 3), as split's pieces do."""

    class Chunks(torch.nn.Module):
        def forward(self, x):
            a, _, c = x.chunk(3, dim=1)
            return a * 2 + c

    x = torch.randn(4, 9)
    graph_module = export_graph(Chunks(), (x,))
    targets = [n.target for n in graph_module.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.chunk.default not in targets and targets.count(torch.ops.aten.slice.Tensor) == 2
    assert torch.equal(graph_module(x), Chunks()(x))
    result = verify_plan(Chunks(), (x,), MESH, capture="export")
    assert result.passed and result.coverage.count("unhandled") == 0, result.coverage.lines()


def test_the_ranks_run_the_graph_that_was_planned(sv_backend):
    """verify_plan captures once and the ranks run that very graph; a plan made on one capture is
    refused by name against another (run_plan), and a worker's own capture that is not the planned
    graph is refused before it runs."""
    import pickle

    from shardverify.errors import InvalidArgument, VerificationError
    from shardverify.plan import make_plan, run_plan
    from shardverify.plan.capture_model import capture_model

    x = torch.randn(8, 8)
    planned = capture_model(FunctionalBlock(), (x,), "export")
    recipe = ModelRecipe(FunctionalBlock(), (x,), capture="export", graph=planned.graph)
    assert traced(recipe) is planned.graph
    sent = pickle.loads(pickle.dumps(recipe))          # a worker: no graph, the planned graph's node names
    assert sent.graph is None and sent.nodes == tuple(n.name for n in planned.graph.graph.nodes)
    assert [n.name for n in traced(sent).graph.nodes] == list(sent.nodes)
    other = ModelRecipe(FunctionalBlock(), (x,), capture="fx", nodes=sent.nodes)
    with pytest.raises(VerificationError, match="not the graph the plan was made on"):
        traced(other)
    model = FunctionalBlock()
    plan = make_plan(model, (x,), MESH, capture="export")
    with pytest.raises(InvalidArgument, match="made on another graph"):
        run_plan(sv_backend(MESH, "simulated"), model, (x,), plan, capture="fx")
    assert run_plan(sv_backend(MESH, "simulated"), model, (x,), plan, capture="export").passed
