"""Real models, captured with torch.export: small random-weight builds of HF transformers' GPT-2,
Llama, BERT, ViT, ResNet, Mixtral, BART, ConvNeXt and Swin (shardverify.plan.hf_zoo), whose plans
specs/plans/ verifies end to end. Here, what those plans do: the solver's plan for the language models shards attention and
the MLP, the tensor-parallel plan shards every weight, data parallelism passes ResNet's batch
norms untouched; Llama's MLP passes Megatron's tensor-parallel plan and a token-parallel plan
(its weights' gradients reduced through the HOOKs), and a dropped reduction in that plan is
caught at the node that owes it."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the HF model zoo needs the models extra: pip install -e '.[models]'")

from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

from shardverify import DeviceMesh, verify_plan  # noqa: E402
from shardverify.plan.coverage import classify_nodes  # noqa: E402
from shardverify.plan.recipe import ModelRecipe, traced  # noqa: E402
from shardverify.plan.hf_zoo import HF_MODELS, hf_model  # noqa: E402
from shardverify.pytest_plugin.made_plans import session_plan  # noqa: E402

pytestmark = pytest.mark.slow   # tiny HF models built, captured, planned and checked: seconds each

# Every zoo model's solver, data-parallel and tensor-parallel plans on (2,2) and (4,), simulated and
# on gloo, with every tensor op handled: specs/plans/{gpt2,llama,bert,vit,resnet,mixtral,lstm,bart,convnext,
# swin}.yaml (generated tests). What follows checks what those plans do, beyond passing.

#: weight matrices (linear, addmm, embedding, conv) in each model: all sharded under shard_weights
WEIGHTS = {"gpt2": ("aten.addmm.default", 4), "llama": ("aten.linear.default", 8),
           "bert": ("aten.linear.default", 6), "vit": ("aten.linear.default", 7), "resnet": ("aten.linear.default", 1),
           "lstm": ("aten.linear.default", 5),   # the head, and the input and three steps' hidden projections of the LSTM
           "mixtral": ("aten.linear.default", 6),   # q, k, v, o, the router, the LM head (the experts': index.Tensor)
           "mixtral-capacity": ("aten.linear.default", 6),   # the same (the experts': einsum)
           "bart": ("aten.linear.default", 16),   # encoder 4 + 2, decoder self 4, cross 4, MLP 2
           "convnext": ("aten.linear.default", 5),   # two blocks' MLPs (2 each) and the classifier
           "swin": ("aten.linear.default", 13)}   # two blocks' q, k, v, o and MLPs (6 each) and the classifier


#: the plans every zoo spec makes on each mesh (made together with the one a test asks for first)
ZOO_PLANS = ("solver", "data_parallel", "shard_weights")
SPECS = Path(__file__).resolve().parents[1] / "specs" / "plans"


def _together(name: str) -> tuple[str, ...]:
    """The plans a zoo model's spec makes beside the one asked (none for a model without a spec)."""
    return ZOO_PLANS if (SPECS / f"{name}.yaml").is_file() else ()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_solvers_plan_of_a_language_model_shards_attention_and_the_mlp(name):
    """At this size the cheapest plan is not all replicated: attention and the MLP shard (the plan
    itself is verified by specs/plans/{gpt2,llama}.yaml: the same plan, made once a session)."""
    _, coverage = session_plan("", (), (), (2, 2), "solver", zoo=name, capture="export", together=_together(name))
    assert not coverage.fallbacks, coverage.lines()
    by_node = {s.node: s.target for s in coverage.statuses}
    sharded = Counter(by_node[node] for node in coverage.sharded)
    matmul = "aten.addmm.default" if name == "gpt2" else "aten.linear.default"
    assert sharded["aten.scaled_dot_product_attention.default"] == 1, sharded
    assert sharded[matmul] >= 2, sharded


def test_a_data_parallel_resnet_takes_the_batch_shard_through_its_batch_norms():
    """Weights replicated, the batch split over every mesh axis along its whole path: ResNet's
    eval-mode batch norm takes the batch shard as it comes, no resharding around it."""
    # the plan specs/plans/resnet.yaml's data_parallel verifies on (2,2), made once a session
    plan, coverage = session_plan("", (), (), (2, 2), "data_parallel", zoo="resnet", capture="export",
                                  together=_together("resnet"))
    norms = [item for item in plan.nodes if item.node.startswith("batch_norm")]
    assert norms and all(item.node in coverage.sharded for item in norms)
    around = [r for item in plan.nodes for r in item.reshards
              if r.node.startswith("batch_norm") or r.producer.startswith("batch_norm")]
    assert not [r for r in around if r.steps], [str(r) for r in around if r.steps]


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_a_plan_sharding_every_weight_of_a_real_model_shards_every_weight(name):
    """At this size the cheapest plan shards little (a collective costs more than the compute it
    saves); asked to shard every weight it can, the solver makes every projection tensor
    parallel (the plan the zoo specs' tensor_parallel verifies: the same plan, made once a session)."""
    mesh = (4,) if name == "mixtral" else (2, 2)   # the mesh the spec's suite runs (specs/plans/mixtral.yaml: (4,))
    _, coverage = session_plan("", (), (), mesh, "shard_weights", zoo=name, capture="export", together=_together(name))
    target, count = WEIGHTS[name]
    by_node = {s.node: s.target for s in coverage.statuses}
    assert sum(by_node[node] == target for node in coverage.sharded) == count, coverage.lines()


def test_a_minimum_the_model_cannot_meet_is_refused():
    from shardverify.plan import PlanInfeasible

    model, inputs = hf_model("resnet")
    with pytest.raises(PlanInfeasible, match="min_sharded=1000, but only"):
        verify_plan(model, inputs, (4,), capture="export", min_sharded=1000)


@pytest.fixture(scope="module")
def llama_mlp():
    """Llama's MLP nodes (gate, up, silu, gate*up, down) and the export graph's strategies on (4,):
    captured and classified once for the module's tests, each of which verifies a fresh build."""
    mesh = DeviceMesh((4,))
    model, inputs = hf_model("llama")
    graph_module = traced(ModelRecipe(model, inputs, capture="export"))
    options, _ = classify_nodes(graph_module, mesh)
    silu = next(n for n in graph_module.graph.nodes if "silu" in str(n.target))
    product = next(iter(silu.users))
    up = next(a for a in product.args if a is not silu)
    down = next(iter(product.users))
    return mesh, options, {"gate": silu.args[0].name, "up": up.name, "silu": silu.name,
                           "product": product.name, "down": down.name}


def _choose(options, node: str, layouts: list[str]) -> str:
    """The strategy of ``node`` whose operand layouts (in order, output last) are ``layouts``."""
    for strategy in options[node]:
        if [str(spec) for _, spec in strategy.sharding_specs] == layouts:
            return strategy.name
    raise AssertionError(f"{node} offers no strategy laid out {layouts}: {[s.name for s in options[node]]}")


def megatron_mlp(options, nodes) -> dict[str, str]:
    """Column-parallel gate and up projections, the activation on the hidden shard, row-parallel
    down projection (its partial output all-reduced)."""
    column = ["[R, R, R]", "[S0, R]", "[R, R, S0]"]
    return {nodes["gate"]: _choose(options, nodes["gate"], column),
            nodes["up"]: _choose(options, nodes["up"], column),
            nodes["silu"]: _choose(options, nodes["silu"], ["[R, R, S0]"] * 2),
            nodes["product"]: _choose(options, nodes["product"], ["[R, R, S0]"] * 3),
            nodes["down"]: _choose(options, nodes["down"], ["[R, R, S0]", "[R, S0]", "[R, R, R]"])}


def test_llama_mlp_tensor_parallel_verifies(llama_mlp):
    mesh, options, nodes = llama_mlp
    model, inputs = hf_model("llama")
    result = verify_plan(model, inputs, mesh, megatron_mlp(options, nodes), capture="export")
    assert result.passed, result.summary()
    assert set(nodes.values()) <= set(result.coverage.sharded)


def test_llama_mlp_token_parallel_reduces_weight_gradients(llama_mlp):
    """Tokens split over the ranks, weights replicated: every weight gradient needs its all-reduce."""
    mesh, options, nodes = llama_mlp
    model, inputs = hf_model("llama")
    plan = {nodes[k]: _choose(options, nodes[k], ["[R, S0, R]", "[R, R]", "[R, S0, R]"])
            for k in ("gate", "up", "down")}
    plan[nodes["silu"]] = _choose(options, nodes["silu"], ["[R, S0, R]"] * 2)
    plan[nodes["product"]] = _choose(options, nodes["product"], ["[R, S0, R]"] * 3)
    result = verify_plan(model, inputs, mesh, plan, capture="export")
    assert result.passed, result.summary()


def test_a_dropped_all_reduce_in_the_tensor_parallel_mlp_is_caught(monkeypatch, llama_mlp):
    from shardverify.plan import execute

    mesh, options, nodes = llama_mlp
    model, inputs = hf_model("llama")
    monkeypatch.setattr(execute, "after_op", lambda comm, strategy, outputs, late, keep_partial=None: outputs)
    result = verify_plan(model, inputs, mesh, megatron_mlp(options, nodes), capture="export")
    first = result.first_divergence()
    assert first is not None and first.phase == "forward" and first.node == nodes["down"], result.summary()


@pytest.mark.dist
def test_llama_mlp_tensor_parallel_verifies_on_gloo(sv_backend, llama_mlp):
    mesh, options, nodes = llama_mlp
    model, inputs = hf_model("llama")
    result = verify_plan(model, inputs, mesh, megatron_mlp(options, nodes), capture="export",
                         backend=sv_backend((4,)))
    assert result.passed, result.summary()
    assert result.backend.startswith(("gloo", "nccl", "process")), result.backend


def test_the_plan_command_runs_a_zoo_model_and_reports_its_coverage(capsys):
    from shardverify.cli.main import main

    # every tensor op of GPT-2 has strategies: --strict passes
    assert main(["plan", "zoo:gpt2", "--mesh", "4", "--shard-weights", "--strict"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PASS: ") and "all 88 ops that compute have verified sharding strategies" in out, out
    # --strict fails a plan that shards nothing (a GRU this small: its decomposition's pieces cost less
    # replicated) or runs ops replicated for want of strategies; the GRU no spec covers is decomposed
    assert main(["plan", "torch.nn.GRU", "--kwarg", "input_size=8", "--kwarg", "hidden_size=8", "--input", "4,5,8",
                 "--mesh", "4", "--capture", "export", "--strict", "-v"]) == 1
    out = capsys.readouterr().out
    assert "'gru' aten.gru.input -> " in out and "aten.sigmoid.default x8" in out, out
    assert "FAIL (strict): " in out and "the plan shards nothing" in out, out


def test_an_unknown_zoo_model_is_a_usage_error(capsys):
    from shardverify.cli.main import main

    assert main(["plan", "zoo:gpt5"]) == 2
    err = capsys.readouterr().err
    assert "no zoo model 'gpt5'" in err and err.count("\n") == 1
