"""Expert parallelism, verified end to end (specs/plans/moe.yaml verifies its three plans): a
GShard-style MoE layer whose experts are split over the mesh while its token groups are split over
it around them, so the plan moves each rank's tokens to their experts' ranks and back with two
all-to-alls; a plan that drops them (every rank keeps only its own group's tokens) is caught at the
first expert matmul. Also the router's tuple (``torch.max`` -> values, ids): each element is laid
out as the producer's strategy gives it, with no resharding of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from shardverify import verify_plan
from shardverify.cli.main import main
from shardverify.plan import execute
from shardverify.plan.spec import spec_plan
from shardverify.plan.zoo import expert_parallel_moe

SPEC = Path(__file__).resolve().parents[1] / "specs" / "plans" / "moe.yaml"


def _model():
    spec = yaml.safe_load(SPEC.read_text())
    torch.manual_seed(0)
    model = expert_parallel_moe(**spec["model"]["kwargs"]).eval()
    x = torch.randn(*spec["inputs"]["x"], generator=torch.Generator().manual_seed(0))
    return model, x, spec["plans"]["expert_parallel"]


def _all_to_alls(plan) -> list[tuple[str, str]]:
    return [(r.node, r.producer) for item in plan.nodes for r in item.reshards
            if any(step.kind == "all_to_all" for step in r.steps)]


def test_the_expert_parallel_plan_moves_tokens_to_their_experts_with_all_to_alls():
    """(specs/plans/moe.yaml verifies the plan; here, what it does.)"""
    model, x, plan = _model()
    built, coverage = spec_plan(model, (x,), (4,), plan, capture="fx")
    # to the experts' ranks before the first expert matmul, back to the groups' ranks after the last
    assert _all_to_alls(built) == [("einsum_1", "einsum"), ("einsum_3", "einsum_2")]
    tuple_elements = [s.node for s in coverage.statuses if s.status == "element"]
    assert tuple_elements == ["getitem", "getitem_1"]          # the router's gate values and expert ids
    by_node = {item.node: item for item in built.nodes}
    assert not [r for name in tuple_elements for r in by_node[name].reshards], "an element moves no data"


def test_a_dropped_all_to_all_is_caught_at_the_node_that_reads_the_tokens(monkeypatch):
    """The planted bug: the exchange never happens, each rank keeping its own group's tokens for
    its experts and nothing from the other groups (shapes as expected, values wrong)."""
    real = execute.apply_reshard

    def dropped(comm, steps, t):
        moved = real(comm, steps, t)
        for step in steps:
            if step.kind == "all_to_all":
                _, concat_dim = step.dims
                own = torch.zeros(moved.shape[concat_dim], dtype=moved.dtype)
                own[comm.rank] = 1.0                       # mesh (4,): group r came from rank r
                shape = [1] * moved.dim()
                shape[concat_dim] = -1
                moved = moved * own.view(shape)
        return moved

    model, x, plan = _model()
    monkeypatch.setattr(execute, "apply_reshard", dropped)
    result = verify_plan(model, (x,), (4,), plan, capture="fx")
    first = result.first_divergence()
    assert not result.passed
    assert first is not None and first.phase == "forward" and first.node == "einsum_1", result.summary()


@pytest.mark.parametrize("layout", ["S0R", "RS0"])
def test_a_tuple_element_takes_its_producers_layout(layout):
    """topk's values and ids, each consumed sharded as topk left them: no reshard between topk
    and their consumers, and the plan verifies (the element's layout is the producer's)."""

    class TopK(torch.nn.Module):
        def forward(self, x):
            values, ids = torch.topk(x, 2, dim=-1 if layout == "S0R" else 0)
            return torch.relu(values) * ids

    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    plan = {"topk": f"{layout} -> {layout}, {layout}", "relu": f"{layout} -> {layout}",
            "mul": f"{layout} x {layout} -> {layout}"}
    result = verify_plan(TopK(), (x,), (4,), plan, capture="fx", strict=True)
    assert result.passed, result.summary()
    moved = [(r.node, r.producer) for item in result.plan.nodes for r in item.reshards if r.steps]
    assert moved == [("topk", "x"), ("output", "mul")], moved   # the input split, the result gathered


def _mixtral_expert_sharded():
    """HF Mixtral (batched_mm experts) with its stacked expert weights split over the experts:
    each rank looks up only its experts' rows of gate_up_proj and down_proj by the tokens' expert
    ids (the others zero: a partial sum, left to the matmul), and the per-copy matmul sums the
    ranks' parts after it."""
    pytest.importorskip("transformers", reason="the HF model zoo needs the models extra")
    from shardverify.plan.hf_zoo import hf_model

    model, inputs = hf_model("mixtral")
    plan = {}
    for lookup, matmul in (("index_4", "bmm"), ("index_5", "bmm_1")):
        plan[lookup] = {"strategy": "S0RR x R -> RRR | P0 sum", "defer": True}   # weights split on the expert dim
        plan[matmul] = "RRR+P0 x RRR -> RRR | P0 sum"
    return model, inputs, plan


def test_mixtral_with_its_stacked_expert_weights_split_over_the_experts_verifies():
    model, inputs, plan = _mixtral_expert_sharded()
    result = verify_plan(model, inputs, (4,), plan, capture="export")
    assert result.passed, result.summary()
    assert {"index_4", "index_5", "bmm", "bmm_1"} <= set(result.coverage.sharded)


def test_a_dropped_reduction_of_the_expert_sharded_matmul_is_caught(monkeypatch):
    model, inputs, plan = _mixtral_expert_sharded()
    real = execute.after_op

    def dropped(comm, strategy, outputs, late, keep_partial=None):   # the matmuls' all-reduce, only
        if strategy.name.startswith("RRR+P0 x"):
            return outputs
        return real(comm, strategy, outputs, late, keep_partial=keep_partial)

    monkeypatch.setattr(execute, "after_op", dropped)
    result = verify_plan(model, inputs, (4,), plan, capture="export")
    first = result.first_divergence()
    assert first is not None and first.phase == "forward" and first.node == "bmm", result.summary()


def _mixtral_pair(capacity: int):
    """zoo:mixtral-capacity (experts routed into slots: shardverify.plan.hf_experts) and HF's own
    Mixtral (batched_mm experts) of the same config with the same weights, and 8 sequences."""
    pytest.importorskip("transformers", reason="the HF model zoo needs the models extra")
    from shardverify.plan.hf_zoo import hf_model, mixtral, mixtral_capacity

    slots, inputs = hf_model("mixtral-capacity")
    if capacity != inputs[0].shape[1]:
        slots = mixtral_capacity(capacity=capacity).eval()
        slots.load_state_dict(hf_model("mixtral-capacity")[0].state_dict())
    own = mixtral(heads=8, experts=8).eval()
    own.load_state_dict(slots.state_dict())
    return slots, own, inputs


def test_experts_in_slots_of_a_whole_sequence_are_transformers_mixtral():
    """With a capacity of a whole sequence no token is dropped: the function, forward and
    backward, is transformers' own to rounding; with a capacity of 2 tokens most are dropped."""
    slots, own, (ids,) = _mixtral_pair(capacity=16)
    out, ref = slots(ids).logits, own(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, a), (_, b) in zip(slots.named_parameters(), own.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    dropping, own, (ids,) = _mixtral_pair(capacity=2)
    assert (dropping(ids).logits - own(ids).logits).abs().max() > 1e-2


def _mixtral_8x7b(device: str, capsys, *extra: str):
    """Mixtral-8x7B's shapes (hidden 4096, 8 experts of 14336, 32 layers) on a mesh of 8, trained in
    bfloat16 with float32 master weights and Adam (16 bytes a parameter), recomputed per layer."""
    code = main(["plan", "zoo:mixtral-capacity", "--mesh", "8", "--cost-size", "hidden=4096,seq=4096,batch=8",
                 "--layers", "32", "--device", device, "--cost-dtype", "bfloat16", "--master-weights",
                 "--recompute", "--json", *extra])
    captured = capsys.readouterr()
    return code, captured


def test_at_mixtral_8x7b_shapes_the_solver_splits_the_experts_over_the_devices(capsys):
    """The experts' weights alone are 45B parameters: 671 GiB with their state, whole on every
    device. On 8 H200s the plan holds each device's own expert (expert parallelism), moves tokens to
    their experts' devices and back with two all-to-alls a layer, and verifies on the tiny build."""
    pytest.importorskip("transformers", reason="the HF model zoo needs the models extra")
    code, captured = _mixtral_8x7b("h200-141gb", capsys)
    report = json.loads(captured.out)
    assert code == 0 and report["passed"], report["headline"]
    assert report["real_size"]["cost"]["memory_bytes"] <= report["device"]["memory_bytes"]
    strategy = {n["node"]: n["strategy"] for n in report["nodes"]}
    for weight in ("model_layers_0_mlp_experts_gate_up_proj", "model_layers_0_mlp_experts_down_proj"):
        assert strategy[weight].startswith("S0RR"), (weight, strategy[weight])    # split on the expert dim
    assert strategy["einsum_1"].startswith("RS0RR") and strategy["einsum_2"].startswith("RS0RR")
    moved = {(n["node"], r["from"]) for n in report["nodes"] for r in n["resharding"]
             if any(step.startswith("all_to_all") for step in r["steps"])}
    assert {("einsum_1", "einsum"), ("einsum_3", "einsum_2")} <= moved, moved
    # every weight kept whole (data parallelism) would hold 712 GiB a device
    code, captured = _mixtral_8x7b("h200-141gb", capsys, "--data-parallel")
    assert code == 2 and "the least any choice of layouts the goals admit holds is 711.9 GiB" in captured.err


def test_at_mixtral_8x7b_shapes_8_h100s_are_refused_with_the_least_memory(capsys):
    pytest.importorskip("transformers", reason="the HF model zoo needs the models extra")
    code, captured = _mixtral_8x7b("h100-80gb", capsys)
    assert code == 2
    assert "no plan fits the memory limit of 80 GiB per device on mesh (8,): the least any choice" in captured.err


def test_the_slots_model_runs_in_a_process_that_never_imported_the_project(tmp_path):
    """A gloo or process worker unpickles the model: that alone registers the experts
    implementation there (transformers looks it up by name at every forward)."""
    import pickle
    import subprocess
    import sys

    slots, _, (ids,) = _mixtral_pair(capacity=16)
    path = tmp_path / "model.pt"
    path.write_bytes(pickle.dumps((slots, ids)))
    expected = slots(ids).logits
    code = ("import pickle, sys, torch; model, ids = pickle.load(open(sys.argv[1], 'rb')); "
            "torch.save(model(ids).logits, sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "out.pt")], check=True, timeout=300)
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected)
