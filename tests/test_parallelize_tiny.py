"""Tiny transformers models for the tensor-parallel plans transformers ships: which architectures
have a plan, and that a representative few build at the tiny sizes (heads 2 and 4 ranks divide),
from nothing downloaded, and give a finite loss and gradients."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

from shardverify.errors import InvalidArgument  # noqa: E402
from shardverify.features.parallelize import architectures, shrunk_config, tiny  # noqa: E402
from shardverify.features.parallelize.tiny import CannotBuild, tiny_config, tiny_model, tp_architectures  # noqa: E402


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_tp_architectures_lists_every_config_that_ships_a_plan():
    from transformers import CONFIG_MAPPING
    found = tp_architectures()
    assert len(found) >= 140 and found == sorted(found)
    assert {"llama", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma3"} <= set(found)
    assert "bert" not in found and "gpt2" not in found    # no plan shipped
    for model_type in ("llama", "gemma3"):                # its own plan; a composite's text sub-config's
        assert architectures.plan_config(CONFIG_MAPPING[model_type]) is not None


def _loss(built) -> torch.Tensor:
    out = built.model(**built.inputs)
    if "labels" in built.inputs:
        return out.loss
    first = out[0] if not isinstance(out, torch.Tensor) else out
    return first.float().pow(2).mean()


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "gemma3", "eurobert"])
def test_representative_models_build_tiny_and_train(model_type):
    built = tiny_model(model_type, seed=0)
    text = built.model.config.get_text_config(decoder=True)
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads) == (64, 4, 4)
    assert (built.heads, built.kv_heads) == (4, 4) and text.vocab_size == 256
    assert 2 <= text.num_hidden_layers <= tiny.MAX_LAYERS
    if getattr(text, "head_dim", None) is not None and not hasattr(text, "qk_rope_head_dim"):
        assert text.head_dim == 16
    assert built.inputs["input_ids"].shape == (2, 16) and int(built.inputs["input_ids"].max()) < 256
    assert built.model.training and next(built.model.parameters()).dtype == torch.float32
    # every rule of the plan names a module or parameter of the tiny model
    names = {n for n, _ in built.model.named_modules()} | {n for n, _ in built.model.named_parameters()}
    assert built.tp_plan
    for key in built.tp_plan:
        pattern = re.compile(re.escape(key).replace(r"\*", r"\d+"))
        assert any(pattern.fullmatch(n) for n in names), key
    loss = _loss(built)
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in built.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_moe_models_have_four_experts_two_per_token_and_an_expert_plan():
    config = tiny_config("qwen3_moe")
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 32)
    assert config.mlp_only_layers == [0]          # one dense layer: the plan's dense MLP rules apply too
    deepseek = tiny_config("deepseek_v3")
    assert deepseek.first_k_dense_replace == 1 and deepseek.n_routed_experts == 4
    assert (deepseek.kv_lora_rank, deepseek.qk_rope_head_dim, deepseek.qk_nope_head_dim) == (32, 8, 8)
    assert tiny_config("mellum").mlp_layer_types == ["dense", "sparse"]   # all sparse by default
    built = tiny_model("qwen3_moe")
    assert built.ep_plan and "labels" in built.inputs


def test_mixed_layer_kinds_keep_one_of_each():
    text = tiny_config("gemma3").text_config
    assert set(text.layer_types) == {"sliding_attention", "full_attention"}
    assert len(text.layer_types) == text.num_hidden_layers
    assert text.sliding_window <= 16 and text.pad_token_id < 256 and text.bos_token_id < 256


def test_mrope_sections_are_rescaled_to_the_tiny_head():
    rope = tiny_config("qwen2_vl").text_config.rope_parameters
    assert sum(rope["mrope_section"]) == tiny.HEAD_DIM // 2
    assert shrunk_config._apportion([22, 22, 20], 8) == [3, 3, 2]


def test_same_seed_same_weights():
    first, again, other = tiny_model("llama", 0), tiny_model("llama", 0), tiny_model("llama", 1)
    a, b, c = (next(m.model.parameters()) for m in (first, again, other))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(first.inputs["input_ids"], again.inputs["input_ids"])


def test_unknown_type_is_refused_with_a_readable_reason():
    with pytest.raises(CannotBuild) as info:
        tiny_model("no_such_model")
    assert isinstance(info.value, InvalidArgument) and info.value.model_type == "no_such_model"
    assert str(info.value).startswith("cannot build a tiny 'no_such_model' model: transformers has no such")
    assert "\n" not in str(info.value)


def test_a_forward_that_needs_more_than_tokens_is_refused_with_what_it_needs():
    with pytest.raises(CannotBuild) as info:
        tiny_model("gemma4_vision")
    assert "requires 'pixel_position_ids'" in info.value.reason


def test_heads_that_ranks_do_not_divide_are_refused():
    with pytest.raises(CannotBuild, match="do not split over 3 ranks"):
        tiny_model("llama", tp_sizes=(3,))


def test_no_randomness_in_a_training_step():
    from transformers import CONFIG_MAPPING
    assert CONFIG_MAPPING["phimoe"]().router_jitter_noise > 0     # the default jitters the router
    config = tiny_config("phimoe")
    assert config.router_jitter_noise == 0.0
    assert all(v == 0.0 for k, v in vars(config).items() if "dropout" in k and isinstance(v, float))


def test_weights_the_model_leaves_uninitialised_come_from_the_seed():
    # this model's initialisation skips its experts' stacked weights (torch.empty: whatever the
    # memory held); two builds from one seed must still agree, and hold no NaN
    first, again = (tiny_model("qwen3_omni_moe_talker_text", seed=0).model.state_dict() for _ in range(2))
    experts = [k for k in first if "experts" in k]
    assert experts
    for key in experts:
        assert torch.equal(first[key], again[key]) and torch.isfinite(first[key]).all(), key


def test_a_part_of_another_model_names_the_model_to_build():
    with pytest.raises(CannotBuild, match=r"part of another model; build 't5gemma2' instead$"):
        tiny_model("t5gemma2_decoder")
