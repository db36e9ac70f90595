"""Plans on a user's own model, the first time, and its input errors: a
newcomer's CLI session on an HF causal LM, an encoder-decoder and a vision model built by their
own factory module (tiny configs, random weights, nothing downloaded), inputs with their dtypes
and names; the model as built (its weights, eval mode), training-mode randomness checked with
every rank drawing as the single device; each value compared in the precision it was computed in
(a float32 upcast inside passes data parallelism), a bool output verified; a dropped backward
all-reduce blamed on the linear that owes it; one strict; an input of the wrong width or dtype
named."""

from __future__ import annotations

import contextlib
import dataclasses
import textwrap

import sys

import pytest
import torch
from torch import nn

from shardverify import verify_plan
from shardverify.cli.main import main
from shardverify.errors import ShardVerifyError
from shardverify.plan import execute
from shardverify.plan.inputs import InputError, InputSpec, parse_input
from shardverify.plan.spec import build_spec_model
from shardverify.sharding.strategy import CommPattern

FACTORIES = textwrap.dedent('''
    """A newcomer's own factory module: tiny HF builds, random weights."""
    import transformers as t


    def qwen2():
        return t.Qwen2ForCausalLM(t.Qwen2Config(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16, use_cache=False, attn_implementation="sdpa"))


    def t5():
        return t.T5ForConditionalGeneration(t.T5Config(
            vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
            use_cache=False))


    def tagger():
        """A factory whose model brings its own example inputs (keyword token ids)."""
        import torch

        model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 4))
        model.example_inputs = lambda: {"input": torch.randint(0, 16, (2, 3))}
        return model


    def convnext():
        return t.ConvNextForImageClassification(t.ConvNextConfig(
            num_channels=3, patch_size=4, num_stages=1, hidden_sizes=[8], depths=[1], num_labels=3))
''')


@pytest.fixture
def factories(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="needs the models extra: pip install -e '.[models]'")
    (tmp_path / "newcomer_models.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)       # a newcomer runs shardverify from their project's folder
    monkeypatch.delitem(sys.modules, "newcomer_models", raising=False)   # an earlier test's folder's module
    return "newcomer_models"


@pytest.mark.parametrize("model, inputs", [
    ("qwen2", ["input_ids=int64[2,4]:0..64"]),
    ("t5", ["input_ids=int64[2,4]:0..32", "decoder_input_ids=int64[2,3]:0..32"]),
    ("convnext", ["pixel_values=float32[2,3,8,8]"]),
], ids=["causal-lm", "encoder-decoder", "vision"])
def test_a_newcomers_cli_session_verifies_an_hf_model_from_their_factory(factories, capsys, model, inputs):
    """No flag beyond the factory, the mesh and the inputs: captured (torch.export, said),
    token ids as int64, keyword inputs by name, verified end to end."""
    argv = ["plan", f"{factories}.{model}", "--mesh", "2"] + [f"--input={text}" for text in inputs]
    status = main(argv)
    captured = capsys.readouterr()
    assert status == 0, captured.out + captured.err
    assert "note: captured with torch.export" in captured.out
    assert captured.out.startswith("PASS"), captured.out     # on a mesh of 2 the cheapest plan may shard nothing


def test_a_factorys_own_example_inputs_need_no_input_flag(factories, capsys):
    assert main(["plan", f"{factories}.tagger", "--mesh", "2"]) == 0, capsys.readouterr().err
    assert "PASS" in capsys.readouterr().out
    assert main(["plan", "shardverify.plan.zoo.linear_chain", "--mesh", "2"]) == 2
    assert "without example_inputs: give its inputs" in capsys.readouterr().err


def test_inputs_take_dtypes_ranges_and_names_and_the_old_form():
    assert parse_input("64,128") == InputSpec("", (64, 128))
    assert parse_input("ids=int64[4,8]:0..128") == InputSpec("ids", (4, 8), torch.int64, 0.0, 128.0)
    assert parse_input("mask=bool[4,8]").dtype == torch.bool
    for bad, why in [("ids=int64[4,8]", "needs its value range"), ("x=float99[2]", "not a torch dtype"),
                     ("x=[2,0]", "positive"), ("x=int64[2]:5..1", "LOW < HIGH")]:
        with pytest.raises(ShardVerifyError, match=why):
            parse_input(bad)
    module, (positional, keywords) = build_spec_model(
        "shardverify.plan.zoo.linear_chain", (), [parse_input("8,32"), parse_input("ids=int64[2,3]:0..5")])
    assert positional[0].dtype == torch.float32 and keywords["ids"].dtype == torch.int64
    assert 0 <= int(keywords["ids"].min()) and int(keywords["ids"].max()) < 5


def test_a_factorys_model_keeps_its_own_weights_in_eval_mode_unless_asked():
    built, _ = build_spec_model("shardverify.plan.zoo.linear_chain", (), (("x", (2, 32)),), seed=3)
    torch.manual_seed(3)
    own = nn.Linear(32, 64)
    assert torch.equal(built.fc1.weight, own.weight) and not built.training
    redrawn, _ = build_spec_model("shardverify.plan.zoo.linear_chain", (), (("x", (2, 32)),), seed=3, redraw=True)
    assert not torch.equal(redrawn.fc1.weight, own.weight)
    assert build_spec_model("shardverify.plan.zoo.linear_chain", (), (("x", (2, 32)),), train=True)[0].training


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.fc(x))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_training_mode_dropout_is_checked_with_every_rank_drawing_as_the_single_device(capture):
    result = verify_plan(DropoutMLP().train(), torch.randn(4, 8), (2,), capture=capture, data_parallel=True)
    assert result.passed, result.mismatches
    drawing = [s for s in result.coverage.statuses if "ropout" in s.target]
    assert drawing and all(s.status == "handled" for s in drawing), result.coverage.statuses
    assert any("draw random numbers" in note and "seed every rank alike" in note for note in result.notes), result.notes


def test_a_check_whose_single_device_drew_other_numbers_fails(monkeypatch):
    """The check is not vacuous: with the single device drawing from another generator state than
    the ranks, the dropout node's values differ and the plan fails there."""
    import shardverify.plan.reference as reference

    monkeypatch.setattr(reference, "generator_state", lambda *call: contextlib.nullcontext())
    result = verify_plan(DropoutMLP().train(), torch.randn(4, 8), (2,), capture="fx", seed=5)
    assert not result.passed and any("drop" in str(m) for m in result.mismatches), result.mismatches


def test_the_cli_plans_training_mode_dropout_and_says_the_ranks_draw_alike(capsys):
    factory = ["plan", "torch.nn.TransformerEncoderLayer", "--kwarg", "d_model=8", "--kwarg", "nhead=2",
               "--kwarg", "dim_feedforward=16", "--kwarg", "batch_first=true", "--input", "2,3,8", "--mesh", "2"]
    assert main([*factory, "--train"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "node(s) draw random numbers" in out and "seed every rank alike" in out


class GemmaNorm(nn.Module):
    """Gemma's RMSNorm: computed in float32 whatever the model's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.weight = nn.Parameter(torch.randn(16))

    def forward(self, x):
        h = self.fc(x)
        f = h.float()
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (f * (1.0 + self.weight.float())).type_as(h)


def test_a_float32_upcast_inside_is_held_to_float32_rounding_under_data_parallelism():
    torch.manual_seed(0)
    result = verify_plan(GemmaNorm(), torch.randn(64, 16), (4,), data_parallel=True)
    assert result.passed and not result.shards_nothing, result.summary()


class Positive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) > 0


def test_a_bool_output_is_compared_exactly_without_a_gradient():
    result = verify_plan(Positive(), torch.randn(4, 8), (2,), data_parallel=True)
    assert result.passed, result.summary()


class NormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc1, self.act = nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU()
        self.fc2 = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        h = self.ln(x)
        return self.fc2(self.act(self.fc1(h))) + h    # ln has two users: the blame finds which is wrong


@pytest.mark.parametrize("capture, linear", [("fx", "fc1"), ("export", "linear")])
def test_a_dropped_column_parallel_backward_all_reduce_is_blamed_on_that_linear(monkeypatch, capture, linear):
    real = execute.before_op

    def dropped(comm, strategy, name, tensor, late):
        keep = tuple(a for a in strategy.communication_actions
                     if a.pattern is not CommPattern.IDENTITY_FWD_ALLREDUCE_BWD)
        return real(comm, dataclasses.replace(strategy, communication_actions=keep), name, tensor, late)

    torch.manual_seed(0)
    model, x = NormMLP(), torch.randn(8, 4, 16)
    assert verify_plan(model, x, (2,), shard_weights=True, capture=capture).passed
    monkeypatch.setattr(execute, "before_op", dropped)
    result = verify_plan(model, x, (2,), shard_weights=True, capture=capture)
    first = result.first_divergence()
    assert first.phase == "owner" and first.node == linear, result.summary()
    assert "an all-reduce of its gradient over mesh axes [0]" in result.summary()


def _users_own(x):
    """A function of the user's: torch.fx keeps it whole (wrapped), and no spec serves it."""
    return x.abs() > 0.5


torch.fx.wrap("_users_own")


class UsersOwn(Positive):
    def forward(self, x):
        return _users_own(self.fc(x))


def test_strict_is_one_meaning_everywhere():
    """verify_plan(strict=True), the CLI's --strict and a plan spec's strict: true (its generated
    test) all refuse through strict_problems: a fallback, and a plan that shards nothing."""
    result = verify_plan(UsersOwn(), torch.randn(4, 8), (2,), strict=True)   # fx: the wrapped function, no handler
    assert not result.passed and result.summary() == ("FAIL (strict): 1 tensor op(s) ran replicated without "
                                                      "strategies (see coverage); the plan shards nothing")
    assert verify_plan(UsersOwn(), torch.randn(4, 8), (2,)).passed
    assert verify_plan(UsersOwn(), torch.randn(4, 8), (2,), capture="export", data_parallel=True, strict=True).passed


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) if int(x.sum()) > 0 else -self.fc(x)


def test_a_model_neither_capture_takes_is_one_error_naming_both_and_what_to_try():
    with pytest.raises(ShardVerifyError, match=r"cannot capture DataDependent: torch\.fx: .*; torch\.export: .*Try:"):
        verify_plan(DataDependent(), torch.ones(2, 4), (2,))


class Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, ids):
        return self.embed(ids)


def test_a_float_where_ids_are_wanted_blames_the_dtype():
    with pytest.raises(InputError, match=r"input 'ids' \(shape \[2, 3\], float32\) does not fit Lookup: its first "
                                         r"layer 'embed' \(Embedding, which wants integer ids \(int64\) in \[0, 32\)\)"):
        verify_plan(Lookup(), torch.randn(2, 3), (2,))


def test_a_factory_module_in_the_current_folder_needs_no_pythonpath(tmp_path):
    """The console script (not ``python -m``, which puts the current folder on the path itself),
    run beside the user's ``mymodel.py``: the module is found there."""
    import os
    import subprocess
    from pathlib import Path

    (tmp_path / "mymodel.py").write_text("import torch\n\n\ndef make():\n"
                                         "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())\n")
    script = Path(sys.executable).with_name("shardverify")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(script), "plan", "mymodel.make", "--input", "input=float32[4,8]", "--mesh", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith("PASS"), done.stdout
