"""Plans at the size people train: the device a plan's figures are for (shardverify.plan.device),
what a training step holds and repeats (shardverify.plan.workload: layers, optimizer state,
recompute), and weights held sharded (shardverify.plan.weights: FSDP / ZeRO-3, and tensor
parallelism with nothing gathered) as choices the solver makes under a memory limit, each plan
verified on the simulated backend against the single device model. The table of known answers is
docs/known_answers.md."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from shardverify import verify_plan
from shardverify.cli.main import main
from shardverify.plan.capture_model import capture_model
from shardverify.plan.export import export_parallelize
from shardverify.plan.device import NOMINAL, PROFILES, device_profile
from shardverify.plan.hf_zoo import hf_model
from shardverify.plan.verify import make_plan
from shardverify.plan.workload import Workload, repeated_block, repeats
from shardverify.sharding.mesh import DEFAULT_ALPHA, DeviceMesh
from shardverify.errors import InvalidArgument
from shardverify.sharding.calibration_file import save_calibration
from shardverify.backends.calibration import fit_mesh


class Layers(nn.Module):
    """A stack of two MLP blocks in a ModuleList (the repeated block), a head outside it."""

    def __init__(self, width: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(blocks))
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _layers(blocks: int = 2):
    torch.manual_seed(0)
    return Layers(blocks=blocks), (torch.randn(8, 16),)


def test_a_weight_carries_its_gradient_and_optimizer_state():
    assert Workload().weight_bytes(10, 4) == 10 * (4 + 4 + 8)                        # float32, Adam
    assert Workload(master_weights=True).weight_bytes(10, 2) == 10 * 16            # bf16 + fp32 master: 16 B
    assert Workload(master_weights=True).weight_bytes(10, 4) == 10 * 16            # float32 needs no master copy
    assert Workload(optimizer="sgd").weight_bytes(10, 4) == 10 * 12
    assert Workload(optimizer="none").weight_bytes(10, 4) == 10 * 8
    with pytest.raises(InvalidArgument, match="unknown optimizer 'lion'; the ones costed are adam, sgd, none"):
        Workload(optimizer="lion")
    with pytest.raises(InvalidArgument, match="layers must be a positive integer, got 0"):
        Workload(layers=0)


def test_the_repeated_block_is_the_numbered_module_most_nodes_run_under():
    model, x = hf_model("llama")
    graph = capture_model(model, x, "export").graph
    block = repeated_block(graph)
    assert block.prefix == "model.layers" and block.copies == 1
    assert {"model_layers_0_self_attn_q_proj_weight", "linear", "scaled_dot_product_attention"} <= block.nodes
    assert "model_embed_tokens_weight" not in block.nodes and "linear_7" not in block.nodes   # the LM head
    assert block.outputs and block.outputs <= block.nodes
    runs, held, _ = repeats(graph, Workload(layers=32, recompute=True))
    assert runs["linear"] == 32 and "linear_7" not in runs
    assert held["model_layers_0_self_attn_q_proj_weight"] == 32    # every layer's weights are held
    assert "linear" not in held                                      # one layer's activations at a time
    assert all(held[name] == 32 for name in block.outputs)


def test_layers_must_divide_among_the_captured_copies_and_need_a_block():
    model, x = _layers(blocks=2)
    graph = capture_model(model, x, "export").graph
    assert repeated_block(graph).copies == 2
    with pytest.raises(InvalidArgument, match=r"holds 2 copies of layers.N, and 5 is not a multiple"):
        repeats(graph, Workload(layers=5))
    flat = capture_model(nn.Sequential(nn.Linear(16, 16)), (torch.randn(4, 16),), "export").graph
    with pytest.raises(InvalidArgument, match="no repeated block"):
        repeats(flat, Workload(layers=4))


def test_layers_multiply_the_blocks_time_and_memory_and_recompute_trades_one_for_the_other():
    model, x = _layers(blocks=2)
    plan = {}    # every node replicated: the same choice costed under three workloads
    one = make_plan(model, x, (2,), plan, capture="export").cost
    many = make_plan(model, x, (2,), plan, capture="export", workload=Workload(layers=8)).cost
    again = make_plan(model, x, (2,), plan, capture="export", workload=Workload(layers=8, recompute=True)).cost
    assert 3 * one.compute < many.compute < 4 * one.compute       # the blocks 4 times over, the head once
    assert 3 * one.weights < many.weights < 4 * one.weights
    assert again.compute > many.compute and again.memory < many.memory
    assert again.weights == many.weights


def test_profiles_map_trailing_axes_onto_the_node_and_say_what_they_are():
    h100 = PROFILES["h100-80gb"]
    assert h100.axis_links((2, 8)) == (h100.across, h100.within)      # 8 per node: the last axis within
    assert h100.axis_links((2, 4)) == (h100.within, h100.within)
    assert h100.mesh((2, 8)).beta[0] > h100.mesh((2, 8)).beta[1]
    assert h100.memory_bytes == 80 * 2 ** 30 and h100.multiply_adds_per_s == pytest.approx(494.5e12)
    assert "989 TFLOP/s" in h100.label and "80 GiB" in h100.label
    assert NOMINAL.mesh((2, 2)).alpha == (DEFAULT_ALPHA, DEFAULT_ALPHA) and NOMINAL.memory_bytes is None
    assert NOMINAL.seconds(1e10, 1e30) == 1.0          # memory traffic is not timed on the nominal device
    assert h100.seconds(1.0, 3.35e12) == pytest.approx(1.0)   # a kernel bound by HBM bandwidth
    with pytest.raises(InvalidArgument, match="unknown device profile 'tpu'; the profiles are nominal, a100-80gb"):
        device_profile("tpu")


def test_the_calibrated_profile_prices_each_axis_as_measured(tmp_path, monkeypatch):
    from test_calibration import model_samples

    truth = DeviceMesh((2, 2), alpha=(4e-5, 1e-5), beta=(3e-9, 1e-9))
    path = tmp_path / "cal.json"
    save_calibration(truth.shape, fit_mesh(truth.shape, model_samples(truth)), backend="gloo", device="cpu",
                     path=path)
    monkeypatch.setenv("SHARDVERIFY_CALIBRATION", str(path))
    profile = device_profile("calibrated", (2, 2))
    mesh = profile.mesh((2, 2))
    assert mesh.beta == pytest.approx(truth.beta) and mesh.alpha == pytest.approx(truth.alpha)
    assert profile.multiply_adds_per_s == 1e10 and "predates its measurement" in profile.about
    with pytest.raises(InvalidArgument, match="measured on a mesh of 2 axes, not \\(4,\\)"):
        profile.mesh((4,))
    save_calibration(truth.shape, fit_mesh(truth.shape, model_samples(truth)), backend="gloo", device="cpu",
                     path=path, multiply_adds_per_s=3e9)
    assert device_profile("calibrated", (2, 2)).multiply_adds_per_s == 3e9


def test_under_a_memory_limit_weights_are_held_sharded_and_the_plan_verifies():
    """Without a limit every weight is held whole; with a limit below the whole weights' bytes, the
    solver holds weights sharded (each device a block of the weight, its gradient and its Adam
    state), gathers them where an op takes them whole, and that plan matches the single device
    model forward and backward; the memory it declares is under the limit."""
    model, x = _layers(blocks=2)
    free = verify_plan(model, x, (2, 2), capture="export")
    assert free.passed and not any(n.node.endswith("weight") and n.strategy for n in free.plan.nodes)
    limit = int(0.5 * free.plan.cost.memory)
    result = verify_plan(model, x, (2, 2), capture="export", memory_limit=limit)
    assert result.passed, result.summary()
    assert result.plan.cost.memory <= limit < free.plan.cost.memory
    held = {n.node: n.strategy.name for n in result.plan.nodes if n.node.endswith("weight") and n.strategy}
    assert any("S" in name for name in held.values()), held
    with pytest.raises(Exception, match="no plan fits the memory limit"):
        make_plan(model, x, (2, 2), capture="export", memory_limit=1000)


def test_a_weight_held_sharded_and_gathered_is_fsdp_and_a_missing_reduction_is_caught():
    """A plan a user writes: the first weight held split over the data-parallel axis (S0R) and
    gathered whole by its linear, which splits the batch: ZeRO-3. It verifies; the same plan with
    the linear's gradient all-reduce removed leaves each rank's weight block with a partial
    gradient, and the check names the weight."""
    model, x = _layers(blocks=2)
    weight = "layers_0_0_weight"
    plan = make_plan(model, x, (2,), {weight: "S0R", "linear": "S0R = S0R x RR_0"}, capture="export")
    gather = plan.node("linear").reshards
    assert any(r.producer == weight and "all_gather" in str(r.steps) for r in gather), gather
    result = verify_plan(model, x, (2,), plan, capture="export")
    assert result.passed, result.summary()
    exported = export_parallelize(result.plan, result.graph_facts)   # no ParallelStyle holds a weight so: said
    assert [i.where for i in exported.inexpressible if "ZeRO-3" in i.reason] == [weight]
    strategy = plan.node("linear").strategy
    kept = tuple(a for a in strategy.communication_actions if a.operand != weight)
    assert len(kept) < len(strategy.communication_actions)
    broken = plan.replace_node("linear", strategy=dataclasses.replace(strategy, communication_actions=kept))
    failed = verify_plan(model, x, (2,), broken, capture="export")
    assert not failed.passed
    assert any("layers.0.0.weight" in str(m) for m in failed.mismatches), failed.summary()


def test_the_cli_says_the_device_and_the_workload_and_refuses_misuse(capsys):
    code = main(["plan", "zoo:llama", "--mesh", "2", "--device", "h100-80gb", "--layers", "4", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"]
    assert report["device"]["name"] == "h100-80gb" and report["workload"]["layers"] == 4
    assert report["cost"]["weight_bytes"] > 0 and report["cost"]["memory_bytes"] >= report["cost"]["weight_bytes"]
    assert main(["plan", "zoo:llama", "--mesh", "2", "--device", "tpu"]) == 2
    assert "unknown device profile 'tpu'" in capsys.readouterr().err
    assert main(["plan", "zoo:llama", "--mesh", "2", "--cost-dtype", "bfloat16"]) == 2
    assert "--cost-dtype is the dtype of a zoo model's real size" in capsys.readouterr().err


@pytest.mark.parametrize("sizes, layers, mesh, sharded", [
    # Llama-2-7B's shapes (hidden 4096, 32 layers, 32 heads) on 8 H100s: replicated weights, their
    # gradients and Adam state are 100 GiB; the plan holds weights sharded or splits them (TP)
    ("hidden=4096,seq=4096,batch=8", 32, "8", True),
    # a 1024-wide, 8-layer Llama on 4 H100s: every weight fits whole, and the blocks run data parallel
    ("hidden=1024,seq=1024,batch=8", 8, "4", False),
])
def test_the_solver_shards_weights_when_memory_requires_it(capsys, sizes, layers, mesh, sharded):
    code = main(["plan", "zoo:llama", "--mesh", mesh, "--cost-size", sizes, "--layers", str(layers),
                 "--device", "h100-80gb", "--cost-dtype", "bfloat16", "--master-weights", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"], report["headline"]
    real = report["real_size"]
    assert real["cost"]["memory_bytes"] <= 80 * 2 ** 30
    held = {n["node"]: n["strategy"] for n in report["nodes"] if n["node"].startswith("model_layers_0")
            and n["node"].endswith("proj_weight")}
    assert len(held) == 7
    assert any("S" in s for s in held.values()) == sharded, held
    if not sharded:   # data parallel: every linear of the block splits the tokens, none its weight
        block = [n for n in report["nodes"] if n["node"] in {f"linear_{i}" for i in range(1, 7)} | {"linear"}]
        assert all(n["strategy"].startswith("S0R = S0R x RR") for n in block), block
    assert math.isclose(real["workload"]["layers"], layers)
