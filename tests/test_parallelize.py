"""shardverify parallelize: the parallelism people ship against the single device. Right plans
pass (float32 and bfloat16 rounding included), each planted mistake is caught and blamed on the
module (and op) at fault, a DTensor bug is told apart from a plan's, and the command's exit status
says which."""

from __future__ import annotations

import pytest
import torch

from shardverify.cli.main import main
from shardverify.features.parallelize import check_parallelize
from shardverify.features.parallelize.report import render

pytest.importorskip("transformers")
pytest_plugins = ["pytester"]


def _check(model, plan, mesh=(2,), **kwargs):
    return check_parallelize(model, plan, mesh, **kwargs)


def test_the_colwise_rowwise_mlp_of_the_public_report_matches_the_single_device():
    result = _check("zoo:mlp", "zoo:mlp")
    assert result.verdict == "right", render(result)
    assert result.compared >= 30 and not result.findings


def test_colwise_and_rowwise_swapped_fail_at_the_first_layer_whose_input_the_plan_misreads():
    result = _check("zoo:mlp", "zoo:mlp-swapped", steps=1)
    assert result.verdict == "fails loudly"
    assert result.culprit.module == "w1" and result.culprit.cause == "plan layouts"
    assert "the whole value" in result.culprit.detail


def test_a_torchtitan_llama_plan_tp_sp_and_loss_parallel_is_right_over_three_adamw_steps():
    result = _check("zoo:titan_llama", "zoo:titan", steps=3)
    assert result.verdict == "right", render(result)
    assert result.steps == 3 and result.compared > 150


def test_bfloat16_rounding_passes_and_a_bug_in_bfloat16_still_fails():
    right = _check("zoo:titan_llama", "zoo:titan", steps=2, dtype=torch.bfloat16)
    assert right.verdict == "right", render(right)
    wrong = _check("zoo:titan_llama", "zoo:titan-norm-left-out", steps=1, dtype=torch.bfloat16)
    assert wrong.verdict == "silently wrong" and wrong.culprit.cause == "partial gradient"


@pytest.mark.parametrize("plant, verdict, module, cause", [
    ("norm-left-out", "silently wrong", "layers.1.ffn_norm", "partial gradient"),
    ("local-output-flipped", "fails loudly", "layers.0.attention.wo", "plan style"),
    ("wrong-input-layouts", "fails loudly", "layers.0.attention_norm", "plan layouts"),
    ("embedding-wrong-dim", "fails loudly", "layers.0.attention_norm", "plan layouts"),
])
def test_each_planted_mistake_is_caught_and_blamed_on_its_module(plant, verdict, module, cause):
    result = _check("zoo:titan_llama", f"zoo:titan-{plant}", steps=1)
    assert result.verdict == verdict, render(result)
    assert (result.culprit.module, result.culprit.cause) == (module, cause), render(result)


def test_a_wrong_input_layout_is_silent_in_inference_and_blamed_the_same():
    result = _check("zoo:titan_llama", "zoo:titan-wrong-input-layouts", mode="inference")
    assert result.verdict == "silently wrong" and result.phase == "forward"
    assert result.culprit.module == "layers.0.attention_norm"
    assert "the whole value on every rank" in result.culprit.detail   # a replicated tensor taken as a shard


def test_a_dtensor_bug_is_blamed_on_its_op_and_dtensor_not_on_the_plan():
    result = _check("zoo:scan_mlp", "zoo:mlp-dtensor-hidden", steps=1)
    assert result.verdict == "silently wrong"
    culprit = result.culprit
    assert (culprit.op, culprit.cause, culprit.upstream) == ("aten.cumsum.default", "DTensor", "cumsum-negative-dim")
    # the same plan on a model without the scan is right: the plan itself is not at fault
    assert _check("zoo:mlp", "zoo:mlp-dtensor-hidden", steps=1).verdict == "right"


def test_a_plan_rule_that_names_no_module_is_counted_and_said():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from shardverify.features.parallelize.plans import styles_plan, transformers_unmatched
    from shardverify.features.parallelize.names import resolve_model

    plan = styles_plan({"w1": ColwiseParallel(), "w2": RowwiseParallel(), "layers.*.w3": ColwiseParallel()},
                       "mlp with a stray rule")
    result = _check("zoo:mlp", plan, mode="inference")
    assert result.verdict == "right" and result.unmatched == ("layers.*.w3",), render(result)
    assert "1 plan rule(s) name no module of the model and apply to nothing: layers.*.w3" in render(result)
    llama = resolve_model("hf:llama", (), 0).build()
    assert transformers_unmatched(llama) == ()
    assert transformers_unmatched(llama, {"model.layers.*.mlp.fc9": "colwise", "model.layers.*.mlp.up_proj": "rowwise"}) \
        == ("model.layers.*.mlp.fc9",)


class _PerKind(torch.nn.Module):
    def forward(self, x, kind):
        return x * (2.0 if kind == "sliding" else 3.0)


class _KindsInOrder(torch.nn.Module):
    """Calls one module once per kind, in the order given: a loop over a ``set`` of layer types
    runs in an order that follows each process's string hash seed."""

    def __init__(self, order):
        super().__init__()
        self.rotary, self.order = _PerKind(), order

    def forward(self, x):
        return sum(self.rotary(x, kind=kind) for kind in self.order)


def test_a_module_called_once_per_kind_is_paired_by_its_kind_not_by_call_order():
    from shardverify.features.parallelize.execute import Trace, _Recorder

    x, traces = torch.ones(2), []
    for order in (("sliding", "full"), ("full", "sliding")):
        trace, model = Trace(), _KindsInOrder(order)
        recorder = _Recorder(model, trace, 1)
        model(x)
        recorder.remove()
        traces.append(trace)
    first, second = traces
    assert "rotary(kind='sliding')" in first.outputs and "rotary(kind='full')" in first.outputs
    assert all(torch.equal(first.outputs[key][0], second.outputs[key][0]) for key in first.outputs)
    assert first.owner["rotary(kind='full')"] == "rotary"


def test_a_data_parallel_rank_is_read_as_its_block_of_the_batch_dim_or_within_each_expert_group():
    from shardverify.features.parallelize.compare import dp_shares

    # [batch 2, seq 3, hidden 4]: dp rank 1 holds batch row 1; a tensor-parallel half of the hidden
    # dim is offered too (it halves a dim as the dp split does), and the whole comes last
    value = torch.arange(24.0).reshape(2, 3, 4)
    shares = dp_shares(value, torch.zeros(1, 3, 4), 2, 1)
    assert torch.equal(shares[0], value[1:]) and torch.equal(shares[-1], value)
    # 2 experts x (2 dp ranks x 3 tokens) flattened, expert-major: rank 0's rows are 0-2 and 6-8
    routed = torch.arange(12.0).unsqueeze(1)
    assert any(torch.equal(share, torch.tensor([[0.0], [1], [2], [6], [7], [8]]))
               for share in dp_shares(routed, torch.zeros(6, 1), 2, 0))
    assert dp_shares(value, torch.zeros(1, 3, 4), 1, 0) == [value]


def test_on_a_data_parallel_mesh_an_experts_per_call_values_are_left_out():
    from shardverify.features.parallelize.check import _routed
    from shardverify.features.parallelize.execute import Trace

    trace = Trace(module_order=["experts.act", "experts.act#2", "norm"],
                  owner={"experts.act": "experts.act", "experts.act#2": "experts.act", "norm": "norm"},
                  outputs={"experts.act": [torch.zeros(3, 4)], "experts.act#2": [torch.zeros(5, 4)],
                           "norm": [torch.zeros(8, 4)]})
    assert _routed(trace) == {"experts.act", "experts.act#2"}


def test_the_shipped_transformers_plan_of_llama_is_right_in_training_and_inference():
    train = _check("hf:llama", "hf", steps=2)
    assert train.verdict == "right", render(train)
    inference = _check("hf:llama", "hf", mode="inference")
    assert inference.verdict == "right", render(inference)


def test_a_transformers_override_that_leaves_a_per_head_norm_unreduced_is_caught():
    from shardverify.features.parallelize.plans import transformers_plan

    plan = transformers_plan({"model.layers.*.self_attn.q_norm": "replicate", "model.layers.*.self_attn.k_norm": "replicate"})
    result = _check("hf:qwen3", plan, steps=1)
    assert result.verdict == "silently wrong", render(result)
    assert result.culprit.cause == "partial gradient" and result.culprit.module.endswith(("q_norm", "k_norm"))


@pytest.mark.dist
def test_heads_that_do_not_divide_over_the_mesh_are_said_and_the_run_confirmed_on_gloo():
    result = _check("zoo:titan_llama", "zoo:titan", (3,), steps=1)
    assert result.verdict == "fails loudly"
    assert any("4 attention heads do not divide over 3" in note for note in result.notes)
    assert any("gloo processes" in note for note in result.notes)


@pytest.mark.dist
def test_torchtitan_tp_sp_loss_parallel_with_fsdp2_on_a_2x2_mesh_is_right_on_gloo_processes():
    result = _check("zoo:titan_llama", "zoo:titan", (2, 2), steps=3)
    assert result.verdict == "right", render(result)
    assert "ran on 4 gloo processes" in result.notes


@pytest.mark.dist
def test_a_planted_partial_gradient_is_caught_on_gloo_processes_as_in_process():
    result = _check("zoo:titan_llama", "zoo:titan-norm-left-out", (2,), steps=1, backend="gloo")
    assert result.verdict == "silently wrong" and result.culprit.cause == "partial gradient"


@pytest.mark.dist
def test_on_a_2x2_mesh_blame_reaches_the_op_on_gloo_processes_and_holds_each_dp_rank_to_its_rows():
    # the op-level look runs again on gloo processes (FSDP2 frees the gathered weights after the
    # forward: the log keeps copies); a DTensor bug is blamed on its op and its page
    scan = _check("zoo:scan_mlp", "zoo:mlp-dtensor-hidden", (2, 2), steps=1)
    assert scan.verdict == "silently wrong", render(scan)
    assert (scan.culprit.op, scan.culprit.cause, scan.culprit.upstream) == \
        ("aten.cumsum.default", "DTensor", "cumsum-negative-dim"), render(scan)
    # a replicated input reaches the norm right (each dp rank its rows); the plan's layouts misread it
    layouts = _check("zoo:titan_llama", "zoo:titan-wrong-input-layouts", (2, 2), steps=1)
    assert (layouts.culprit.module, layouts.culprit.cause) == ("layers.0.attention_norm", "plan layouts"), render(layouts)
    assert "the whole value on every rank" in layouts.culprit.detail


def test_the_command_exits_0_right_1_wrong_2_bad_input(capsys):
    assert main(["parallelize", "zoo:mlp", "--plan", "zoo:mlp", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PASS: 1 of 1 runs") and "RIGHT: zoo:mlp" in out
    assert main(["parallelize", "zoo:titan_llama", "--plan", "zoo:titan-norm-left-out", "--steps", "1"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL") and "first culprit: layers.1.ffn_norm" in out
    assert main(["parallelize", "zoo:nothing", "--plan", "zoo:mlp"]) == 2
    assert "no zoo model 'nothing'" in capsys.readouterr().err
    assert main(["parallelize", "zoo:mlp"]) == 2      # no plan for a non-transformers model


def test_the_commands_text_puts_the_verdict_and_the_first_culprit_first(capsys):
    """Several runs: PASS or FAIL over all, then the first wrong run's culprit (which run said),
    then each run's own verdict; the culprit is not repeated under its run."""
    argv = ["parallelize", "zoo:titan_llama", "--plan", "zoo:titan-norm-left-out", "--mode", "both", "--steps", "1"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == "FAIL: 1 of 2 runs match the single device (zoo:titan_llama under titan-norm-left-out)"
    assert lines[1].startswith("first culprit: layers.1.ffn_norm: a partial gradient is never reduced")
    assert lines[1].endswith("[mesh 2, train]"), lines[1]
    assert lines[2].startswith("SILENTLY WRONG (gradients): zoo:titan_llama") and "mesh 2, train" in lines[2]
    assert captured.out.count("first culprit") == 1 and any(line.startswith("RIGHT: ") for line in lines)
    assert captured.err == ""      # no status line: stderr is not a terminal here


def test_a_transformers_plan_with_overrides_is_text_a_process_can_rebuild(capsys):
    from shardverify.features.parallelize.names import overrides_text, resolve_plan

    text = overrides_text({"embed_tokens": "embedding_colwise"})
    assert resolve_plan(text).styles == {"embed_tokens": "embedding_colwise"}
    assert main(["parallelize", "hf:llama", "--tp-override", "embed_tokens", "--mode", "inference"]) == 2
    assert "--tp-override 'embed_tokens': expected PATTERN=STYLE" in capsys.readouterr().err
    assert main(["parallelize", "zoo:mlp", "--plan", "zoo:mlp", "--tp-override", "w1=colwise"]) == 2
    assert "--tp-override changes a transformers plan" in capsys.readouterr().err
    assert main(["parallelize", "hf:llama", "--plan", 'hf:{"a": 3}', "--mode", "inference"]) == 2
    assert "expected a JSON object of at most 200 module patterns to style names" in capsys.readouterr().err


def test_the_pytest_fixture_passes_a_right_plan(parallel_plan):
    assert parallel_plan("zoo:mlp", "zoo:mlp", steps=1).verdict == "right"


def test_the_pytest_fixture_fails_a_wrong_plan_with_its_culprit(pytester):
    pytester.makepyfile("""
        def test_my_plan(parallel_plan):
            parallel_plan("zoo:titan_llama", "zoo:titan-norm-left-out", steps=1)
    """)
    result = pytester.runpytest("-p", "no:xdist")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*SILENTLY WRONG (gradients)*", "*first culprit: layers.1.ffn_norm*"])


def test_a_users_own_factory_and_parallelize_function_from_their_project(tmp_path, monkeypatch):
    (tmp_path / "myproject.py").write_text(
        "import torch\n"
        "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)\n"
        "    def forward(self, x):\n"
        "        return self.down(torch.tanh(self.up(x)))\n"
        "def build():\n"
        "    return Net()\n"
        "def parallelize(model, mesh):\n"
        "    parallelize_module(model, mesh['tp'], {'up': ColwiseParallel(), 'down': RowwiseParallel()})\n"
        "def parallelize_wrong(model, mesh):\n"
        "    parallelize_module(model, mesh['tp'], {'up': ColwiseParallel(), 'down': ColwiseParallel()})\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    right = _check("myproject.build", "myproject.parallelize", inputs=["x=8,16"], steps=1)
    assert right.verdict == "right", render(right)
    wrong = _check("myproject.build", "myproject.parallelize_wrong", inputs=["x=8,16"], steps=1)
    assert wrong.verdict != "right" and wrong.culprit.module == "down", render(wrong)


def test_the_transformers_sweep_stores_each_row_resumes_and_distrusts_an_edited_row(tmp_path, monkeypatch):
    import json

    from shardverify.features.parallelize import sweep as sweep_module

    rows = sweep_module.sweep(["llama"], [(2,)], ["inference"], tmp_path)
    assert [(r.architecture, r.mesh, r.mode, r.outcome) for r in rows] == [("llama", (2,), "inference", "right")]
    stored = tmp_path / "llama--2--inference.json"
    assert json.loads(stored.read_text())["outcome"] == "right"

    def no_runs(*args, **kwargs):
        raise AssertionError("a stored row was checked again")

    monkeypatch.setattr(sweep_module, "check_row", no_runs)
    again = sweep_module.sweep(["llama"], [(2,)], ["inference"], tmp_path)             # resumed from the store
    assert [r.record() for r in again] == [r.record() for r in rows]
    edited = json.loads(stored.read_text())
    edited["outside"] = 3                                                              # "right" with values outside
    stored.write_text(json.dumps(edited))
    assert sweep_module.sweep(["llama"], [(2,)], ["inference"], tmp_path, run=False) == []
    page = sweep_module.render_page([], ["llama"], [(2,)], ["inference"])
    assert "| llama | 2 | not run |" in page and "1 rows not run yet" in page
    rules = sweep_module.plan_rules(["llama"], tmp_path)
    assert rules[0].rules > 5 and rules[0].unmatched == ()
    assert sweep_module.plan_rules(["llama"], tmp_path, run=False) == rules     # stored
    facts = tmp_path / "llama--plan.json"
    facts.write_text(json.dumps({"architecture": "llama", "rules": 1, "unmatched": ["a", "b"]}))   # more than it has
    assert sweep_module.plan_rules(["llama"], tmp_path, run=False) == []
    page = sweep_module.render_page(rows, ["llama"], [(2,)], ["inference"],
                                    [sweep_module.PlanRules("llama", 9, ("layers.*.mlp.fc9",))])
    assert "1 of them, in 1 architectures, name no module" in page and "- llama (1 of 9): `layers.*.mlp.fc9`" in page


def test_the_sweep_page_is_what_the_stored_results_give():
    from pathlib import Path

    from shardverify.features.parallelize.sweep import plan_rules, render_page, sweep
    from shardverify.features.parallelize.tiny import tp_architectures

    root = Path(__file__).resolve().parents[1]
    folder, meshes, modes = root / "results" / "parallelize", [(2,), (4,), (2, 2)], ("train", "inference")
    shipped = tp_architectures()
    rows = sweep(shipped, meshes, modes, folder, run=False)
    assert len(rows) == len(shipped) * len(meshes) * len(modes)      # every row stored, and each one checks
    page = render_page(rows, shipped, meshes, modes, plan_rules(shipped, folder, run=False))
    assert page == (root / "docs" / "transformers_tp_plans.md").read_text(), \
        "docs/transformers_tp_plans.md is stale: shardverify parallelize --sweep-hf --mesh 2 --mesh 4 --mesh 2,2 " \
        "--stored --write docs/transformers_tp_plans.md"


@pytest.mark.dist
def test_a_data_parallel_rank_is_held_to_its_share_of_tokens_flattened_with_the_batch():
    # an MoE router sees [batch * seq, hidden]: a dp rank holds a dp-th of the rows, batch outermost
    result = _check("hf:mixtral", "hf", (2, 2), mode="inference")
    assert result.verdict == "right", render(result)
