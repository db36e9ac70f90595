"""Tiny, randomly initialised transformers models for every architecture whose config ships a
tensor-parallel plan (``base_model_tp_plan``), so the plan transformers itself applies
(``maybe_distribute_model``) can be run on 2 and 4 ranks against the single-device model.

Nothing is downloaded (no hub access, no tokenizer): each model is built with ``from_config`` from
its config class's defaults, every size the config (and each sub-config) has shrunk, whatever the
config calls it. The sizes are chosen so that 2 and 4 ranks divide what a plan shards: 4 attention
heads and 4 key/value heads of 16 (hidden 64), MLP widths 128, 4 experts (2 per token, widths 32),
MLA ranks 32, state-space mixers of 4 heads, a vocabulary of 256 with every special token id inside
it (the inputs draw below them, so a text-only batch holds no image token), 128 positions. Two
layers, or one of each kind where the config mixes kinds (sliding and full attention, dense and
MoE, attention and linear or state-space mixers; at most four), the first layer dense where the
config has dense-first MoE, so that every rule of the plan finds a module. Where the defaults leave
a size to the checkpoint (None) or are inconsistent for a small model, :data:`_FIXES` says what a
checkpoint's config would. Dropout is off and the weights come from ``torch.manual_seed(seed)``;
train/eval mode is the caller's. A model whose forward cannot run on its tiny inputs is refused
(:class:`CannotBuild`, one line saying why) before any check starts.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from shardverify.errors import InvalidArgument

__all__ = ["CannotBuild", "TinyModel", "tiny_model", "tp_architectures", "tiny_config",
           "BATCH", "SEQ", "HIDDEN", "FFN", "LAYERS", "HEADS", "KV_HEADS", "HEAD_DIM", "VOCAB"]

BATCH, SEQ = 2, 16
GRID = 4                  # a vision tower's images: GRID x GRID patches
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 4, 16
VOCAB, POSITIONS = 256, 128
EXPERTS, EXPERTS_PER_TOKEN, EXPERT_FFN = 4, 2, 32
CHANNELS = 32            # convolution widths (of vision/audio towers): GroupNorm's 32 groups divide them
MAX_LAYERS = 4            # layers kept where a config mixes layer kinds
SPECIAL_IDS = 32          # ids VOCAB-32 .. VOCAB-1 are the special tokens; inputs draw below them


class CannotBuild(InvalidArgument):
    """No tiny model of this architecture: the model type and why, in one line."""

    def __init__(self, model_type: str, reason: str) -> None:
        self.model_type, self.reason = model_type, reason
        super().__init__(f"cannot build a tiny '{model_type}' model: {reason}")


@dataclass(frozen=True)
class TinyModel:
    """A tiny model with its inputs and the plans its config ships (resolved to the model's own
    module names by transformers: a task model's ``model.`` prefix included)."""

    model_type: str
    model: torch.nn.Module
    inputs: dict[str, torch.Tensor]
    tp_plan: dict
    ep_plan: dict
    heads: int
    kv_heads: int
    note: str


# every size a config may call by one of these names, and its tiny value
_SIZES: tuple[tuple[int, tuple[str, ...]], ...] = (
    (HIDDEN, ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim", "hidden_dim", "n_embed",
             "word_embed_proj_dim", "out_hidden_size", "text_hidden_size", "projection_dim",
             "kv_channels_hidden", "hidden_sizes")),
    (FFN, ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "encoder_ffn_dim",
          "decoder_ffn_dim", "mlp_dim", "dense_intermediate_size", "intermediate_size_mlp")),
    (EXPERT_FFN, ("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size",
                 "moe_ffn_hidden_size", "expert_ffn_dim", "moe_shared_expert_intermediate_size",
                 "shared_intermediate_size", "moe_ffn_dim")),
    (HEADS, ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
            "n_heads", "num_attn_heads")),
    (KV_HEADS, ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "n_kv_head",
               "num_key_value_groups_heads")),
    (HEAD_DIM, ("head_dim", "attention_head_dim", "kv_channels", "v_head_dim", "head_size")),
    (VOCAB, ("vocab_size",)),
    (POSITIONS, ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
                "seq_length")),
    (EXPERTS, ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")),
    (EXPERTS_PER_TOKEN, ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_k",
                        "num_selected_experts", "top_k_experts", "moe_top_k")),
    (32, ("kv_lora_rank", "q_lora_rank")),
    (8, ("qk_rope_head_dim", "qk_nope_head_dim")),
    (1, ("n_group", "topk_group", "n_shared_experts", "num_shared_experts", "moe_num_shared_experts")),
    (32, ("codebook_size",)),
    (8, ("num_filters",)),
    (LAYERS, ("decoder_num_layers", "encoder_num_layers")),
)
SIZES: dict[str, int] = {name: value for value, names in _SIZES for name in names}
_HEAD_NAMES = next(names for value, names in _SIZES if "num_attention_heads" in names)
_KV_NAMES = next(names for value, names in _SIZES if "num_key_value_heads" in names)
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers", "encoder_layers",
                "decoder_layers", "num_encoder_layers", "depth", "num_layers_per_stack")
_LAYER_COUNT_SET = set(LAYER_COUNTS)
#: how many of the first layers are dense (the rest MoE): one, so both kinds are built
_DENSE_FIRST = ("first_k_dense_replace", "num_dense_layers")
#: layers below this index use full attention, above it sliding windows
_WINDOW_LAYERS = ("max_window_layers",)
_TOKEN_ID = re.compile(r".*token_ids?$|.*token_index$|.*_token$")
_FIRST_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}


def _transformers():
    try:
        import transformers
    except ImportError as exc:   # the extra is not installed
        raise InvalidArgument("tiny transformers models need transformers: pip install -e '.[models]'") from exc
    return transformers


def _plan_config(cls: type) -> type | None:
    """The config class whose ``base_model_tp_plan`` the architecture's model applies: the class
    itself, else the first sub-config class that has one (a composite model's language model)."""
    if getattr(cls, "base_model_tp_plan", None):
        return cls
    for sub in (getattr(cls, "sub_configs", None) or {}).values():
        if isinstance(sub, type) and getattr(sub, "base_model_tp_plan", None):
            return sub
    return None


def tp_architectures() -> list[str]:
    """Every model type transformers knows whose config (or one of its sub-configs: a composite
    model's language model or encoder) ships a non-empty ``base_model_tp_plan``, sorted. Reads the
    config classes' class attributes, instantiating none; only the model packages whose
    configuration source names a plan are imported (the other ~400 cost seconds and declare none)."""
    return list(_tp_architectures())


@functools.cache
def _tp_architectures() -> tuple[str, ...]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name
    mapping = _transformers().CONFIG_MAPPING
    root = os.path.join(os.path.dirname(_transformers().__file__), "models")
    found = []
    for model_type in CONFIG_MAPPING_NAMES:
        if not _declares_plan(os.path.join(root, model_type_to_module_name(model_type))):
            continue
        try:
            cls = mapping[model_type]
        except Exception:   # an optional dependency of that config missing: it ships no usable plan here
            continue
        if _plan_config(cls) is not None:
            found.append(model_type)
    return tuple(sorted(found))


@functools.cache
def _declares_plan(package: str) -> bool:
    """Whether a model package's configuration source mentions ``base_model_tp_plan``."""
    try:
        names = [n for n in os.listdir(package) if n.startswith("configuration_") and n.endswith(".py")]
        return any("base_model_tp_plan" in _read(os.path.join(package, n)) for n in names)
    except OSError:
        return False


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as source:
        return source.read()


# --- the tiny config ---------------------------------------------------------------------------------

def _get(config, name: str, default=None):
    """A config attribute, per-layer ones of a heterogeneous config too (their global value)."""
    read = getattr(config, "_getattr_without_heterogeneous_validation", None)
    return read(name, default) if read else getattr(config, name, default)


def _fields(config) -> dict[str, Any]:
    """The init fields of a (dataclass) config with their current values."""
    missing = object()
    values = {f.name: _get(config, f.name, missing) for f in dataclasses.fields(config) if f.init}
    return {name: value for name, value in values.items() if value is not missing}


def _per_layer(config) -> dict[int, dict[str, Any]]:
    """A heterogeneous config's per-layer overrides (layer index: attributes), else {}."""
    spec = config.__dict__.get("_heterogeneity_spec")
    return {int(i): dict(v) for i, v in (getattr(spec, "per_layer_overrides", None) or {}).items()}


def _is_config(value) -> bool:
    return hasattr(value, "to_dict") and dataclasses.is_dataclass(value) and hasattr(value, "model_type")


def _layer_plan(values: dict[str, Any], per_layer: dict[int, dict], old: int) -> list[int]:
    """Which of the ``old`` layers to keep: the first of every kind (a kind: the layer's entry in
    every per-layer list, whether index lists name it, dense or sparse, its per-layer overrides),
    at least two, at most MAX_LAYERS."""
    lists = [v for v in values.values() if isinstance(v, (list, tuple)) and len(v) == old and old > 1]
    index_lists = [set(v) for k, v in values.items() if _is_index_list(k, v, old)]
    dense = values.get("first_k_dense_replace")
    steps = [values.get(k) for k in _LAYER_STEPS]
    steps = [s for s in steps if isinstance(s, int) and not isinstance(s, bool) and s > 1]
    kinds: dict[tuple, int] = {}
    for i in range(old):
        kind = (tuple(repr(v[i]) for v in lists), tuple(i in s for s in index_lists),
                isinstance(dense, int) and i < dense, tuple((i + 1) % s == 0 for s in steps),
                repr(sorted(per_layer.get(i, {}).items())))
        kinds.setdefault(kind, i)
    keep = sorted(kinds.values())[:MAX_LAYERS]
    extra = [i for i in range(old) if i not in keep]
    while len(keep) < min(LAYERS, old) and extra:
        keep = sorted(keep + [extra.pop(0)])
    return keep


_LAYER_STEPS = ("sliding_window_pattern", "decoder_sparse_step", "interleave_moe_layer_step", "moe_layer_freq",
                "global_attn_every_n_layers", "full_attention_interval")


def _is_index_list(name: str, value, old: int) -> bool:
    return ("layer" in name or "idx" in name or "indices" in name) and isinstance(value, (list, tuple)) \
        and bool(value) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < old for i in value) \
        and len(value) != old


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _size(name: str) -> int | None:
    """The tiny value of a size called ``name``: by the table, else by the name's pattern."""
    if name in SIZES:
        return SIZES[name]
    return next((value for pattern, value in _SIZE_PATTERNS if pattern.fullmatch(name)), None)


_CHANNELS = re.compile(r"\w*_channels?")
_SIZE_PATTERNS = ((re.compile(r"\w*vocab_size\w*"), VOCAB),
                  (re.compile(r"\w*hidden_size(_\w+)?"), HIDDEN),
                  (re.compile(r"\w*expert_num"), EXPERTS),
                  (re.compile(r"adapter_\w*dim"), HIDDEN),
                  (_CHANNELS, CHANNELS),
                  (re.compile(r"(num_)?\w*(kv|key_value)_heads"), KV_HEADS),
                  (re.compile(r"num_\w*_heads|\w*_num_heads|\w*_attention_heads"), HEADS),
                  (re.compile(r"\w*expert\w*_(dim|size|dims)"), EXPERT_FFN),
                  (re.compile(r"\w*intermediate_size"), FFN),
                  (re.compile(r"(?!qk_rope)\w*head_dim"), HEAD_DIM))


def _sizes(values: dict[str, Any], moe: bool = False) -> dict[str, Any]:
    """The tiny value of every size, dropout and window in ``values`` (a size of 0, switched off,
    stays 0); of a mixture of experts' expert sizes its defaults leave to the checkpoint too."""
    changes: dict[str, Any] = {}
    for name, value in values.items():
        tiny = _size(name)
        if name not in SIZES and _CHANNELS.fullmatch(name) and not (_is_int(value) and value > CHANNELS) \
                and not isinstance(value, (list, tuple)):
            continue   # image channels (3), or already small
        if tiny is not None and ((_is_int(value) and value > 0) or (value is None and (
                name in _EVEN_IF_NONE or (moe and name in _MOE_SIZES)))):
            changes[name] = tiny
        elif tiny is not None and isinstance(value, (list, tuple)) and value and all(_is_int(v) for v in value) \
                and name not in _LAYER_COUNT_SET:
            changes[name] = type(value)(tiny for _ in value)     # one size per layer (or stage)
        elif name == "rotary_dim" and _is_int(value):
            changes[name] = HEAD_DIM // 2
        elif ("dropout" in name or "pdrop" in name or name.endswith("drop_rate") or name == "layerdrop"
              or "jitter" in name) and isinstance(value, float):
            changes[name] = 0.0     # no randomness in a training step: dropout, router jitter
        elif name in _WINDOWS and _is_int(value) and value > 8:
            changes[name] = 8
    hidden = values.get("hidden_size")
    for name, value in values.items():   # a width that must equal the hidden size (adapters, codebooks)
        if name not in changes and _is_int(hidden) and hidden > HIDDEN and value == hidden \
                and re.search(r"dim|size", name) and name not in _LAYER_COUNT_SET:
            changes[name] = HIDDEN
    if _is_int(values.get("head_dim")) and values.get("head_dim") == values.get("qk_rope_head_dim") \
            and "qk_rope_head_dim" in changes:
        changes["head_dim"] = changes["qk_rope_head_dim"]   # MLA: the rotary embedding's width
    return changes


#: sizes set even where the default leaves them None (the model would derive them from the old sizes)
_EVEN_IF_NONE = {"head_dim", "num_key_value_heads", "num_experts_per_tok", "v_head_dim"}
#: a mixture of experts' sizes whose defaults may leave them to the checkpoint (None)
_MOE_SIZES = {"num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "n_shared_experts",
              "moe_intermediate_size", "expert_intermediate_size", "num_experts_per_tok", "top_k_experts",
              "moe_topk"}
_WINDOWS = ("sliding_window", "attention_window", "window_size", "local_window_size", "sliding_window_size")


def _rope(rope, half: int, mrope: tuple[int, ...] | None = None):
    """Rope parameters with an M-RoPE section (time, height, width) rescaled to sum to ``half`` (the
    tiny rotary dim's half), per layer type too; given one where the model reads a section its
    config leaves out (``mrope``: the model's own default, which fits the full-size head only)."""
    if not isinstance(rope, dict) or not rope:
        return rope
    rope = {k: _rope(v, half, mrope) if isinstance(v, dict) else v for k, v in rope.items()}
    if any(isinstance(v, dict) for v in rope.values()):
        return rope      # one set of parameters per layer type
    factor = rope.get("partial_rotary_factor")
    if isinstance(factor, float) and (HEAD_DIM * factor) % 2:
        rope["partial_rotary_factor"] = max(2, 2 * round(HEAD_DIM * factor / 2)) / HEAD_DIM   # an even rotary dim
    if mrope and "mrope_section" not in rope and "mrope_sections" not in rope:
        rope["mrope_section"] = list(mrope)
    for key in ("mrope_section", "mrope_sections"):
        section = rope.get(key)
        if isinstance(section, (list, tuple)) and section and all(_is_int(x) for x in section) and sum(section):
            rope[key] = _apportion(section, half)
    return rope


def _apportion(section, total: int) -> list[int]:
    """``section`` scaled to sum to ``total`` (largest remainders; equal parts stay equal where they can)."""
    exact = [total * x / sum(section) for x in section]
    new = [max(1, int(x)) for x in exact]
    for i in sorted(range(len(new)), key=lambda i: int(exact[i]) - exact[i])[:max(0, total - sum(new))]:
        new[i] += 1
    return new


def _shrink(config):
    """A copy of ``config`` (a config object) with every size it has shrunk, its sub-configs too."""
    values = _fields(config)
    per_layer = _per_layer(config)
    moe = bool(getattr(type(config), "base_model_ep_plan", None))
    changes = _sizes(values, moe)
    for name, value in values.items():
        if _is_config(value):
            changes[name] = _shrink(value)
        elif isinstance(value, dict) and name.endswith("_config") and "model_type" in value:
            changes[name] = _shrink(_transformers().CONFIG_MAPPING[value["model_type"]](**value))
        elif name == "use_cache":
            changes[name] = False
    changes.update(_token_ids(values))
    changes.update(_layers({**values, **changes}, per_layer, moe))
    new_layers = next((changes[k] for k in LAYER_COUNTS if k in changes), LAYERS)
    for name in _DENSE_FIRST:
        if _is_int(values.get(name)):
            changes[name] = 1
    for name in _WINDOW_LAYERS:
        if _is_int(values.get(name)):
            changes[name] = min(values[name], new_layers)
    if "qk_head_dim" in values and "qk_nope_head_dim" in changes and "qk_rope_head_dim" in changes:
        changes["qk_head_dim"] = changes["qk_nope_head_dim"] + changes["qk_rope_head_dim"]
    layer_types = changes.get("layer_types", values.get("layer_types")) or ()
    if "sliding_window" in values and values["sliding_window"] is None \
            and any("sliding" in str(kind) for kind in layer_types):
        changes["sliding_window"] = 8
    changes.update(_mamba(values))
    patch = changes.get("patch_size", values.get("patch_size"))
    if _is_int(patch) and _is_int(values.get("image_size")) and values["image_size"] > GRID * patch:
        changes["image_size"] = GRID * patch    # a vision tower's images: GRID x GRID patches
    if "mlp_only_layers" in values and isinstance(values["mlp_only_layers"], (list, tuple)):
        changes["mlp_only_layers"] = [0]        # a dense layer, then MoE: the plan's rules for both apply
    kinds = changes.get("mlp_layer_types")
    if isinstance(kinds, list) and "sparse" in kinds and "dense" not in kinds and len(kinds) > 1:
        changes["mlp_layer_types"] = ["dense", *kinds[1:]]    # likewise where the config lists the kinds
    if _is_int(values.get("prefix_dense_intermediate_size")) or "prefix_dense_intermediate_size" in values:
        changes["prefix_dense_intermediate_size"] = FFN
    if _is_int(values.get("num_kv_shared_layers")):
        changes["num_kv_shared_layers"] = 0     # the kept layers' kinds need not all produce a cache
    changes.update(_FIXES.get(getattr(config, "model_type", ""), {}))
    if "rope_parameters" in changes or "rope_parameters" in values:
        changes["rope_parameters"] = _rope(changes.get("rope_parameters", values.get("rope_parameters")),
                                           _rotary_half(values, changes), _mrope_default(type(config)))
    return type(config)(**{**values, **changes})


def _mamba(values: dict[str, Any]) -> dict[str, Any]:
    """A state-space mixer's sizes: 4 heads over its inner width (expand x hidden), state 16, chunks
    of 16 tokens, at most 4 groups (so 2 and 4 ranks divide heads and groups)."""
    changes: dict[str, Any] = {}
    expand = next((values[k] for k in ("mamba_expand", "expand") if _is_int(values.get(k))), 2)
    inner = expand * HIDDEN
    for name, value in values.items():
        if not _is_int(value) or value <= 0:
            continue
        if name in ("mamba_n_heads", "mamba_num_heads"):
            changes[name] = HEADS
        elif name in ("mamba_d_head", "mamba_head_dim"):
            changes[name] = inner // HEADS
        elif name in ("mamba_d_ssm",):
            changes[name] = inner
        elif name in ("mamba_d_state", "ssm_state_size", "state_size", "d_state"):
            changes[name] = 16
        elif name in ("mamba_chunk_size", "chunk_size"):
            changes[name] = SEQ
        elif name in ("n_groups", "mamba_n_groups"):
            changes[name] = min(value, HEADS)
    return changes


#: what a config's defaults leave unset or inconsistent (a checkpoint's config sets it), by model type
_FIXES: dict[str, dict[str, Any]] = {
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"]},
    "step3p5": {"sliding_window": 8},
    "qwen4_exp_text": {"indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
                       "indexer_budget": 8, "indexer_compress_ratio": 4},
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1, "num_hidden_layers": 3,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "gemma4_text": {"enable_moe_block": True},   # its plan shards the MoE block the defaults switch off
    # the pixel-shuffle adapter's MLP reads hidden / ratio^2 features
    "llama4_vision_model": {"intermediate_size": 4 * HIDDEN, "projector_input_dim": HIDDEN,
                            "projector_output_dim": HIDDEN, "vision_output_dim": HIDDEN},
    "t5gemma2_text": {"dropout_rate": 0.0},   # read by the model, not declared by the config
    "qwen3_omni_moe_talker_text": {"shared_expert_intermediate_size": EXPERT_FFN},
    "granite4_vision": {"deepstack_layer_map": [(0, 0)], "spatial_target_layers": [0, 1], "downsample_rate": "1/4"},
    # sliding-window layers have twice the key/value heads of the full-attention ones
    "mimo_v2_flash": {"num_attention_heads": 2 * HEADS, "num_key_value_heads": KV_HEADS},
    "apertus1p5": {"image_token_offset": 128, "audio_token_offset": 160},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "hunyuan_vl_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "mrope_section": [2, 2, 2, 2]}},
}


def _rotary_half(values: dict[str, Any], changes: dict[str, Any]) -> int:
    """Half the tiny rotary dim: of the rope part of an MLA head, else of the (partially rotated) head."""
    rotary = changes.get("qk_rope_head_dim", changes.get("head_dim", HEAD_DIM))
    rope = values.get("rope_parameters")
    factor = (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) \
        or values.get("partial_rotary_factor") or 1.0
    return int(rotary * factor) // 2


@functools.cache
def _mrope_default(config_cls: type) -> tuple[int, ...] | None:
    """The M-RoPE section the config's model falls back to when its rope parameters have none."""
    import importlib
    try:
        module = importlib.import_module(config_cls.__module__.replace(".configuration_", ".modeling_"))
        found = _MROPE_DEFAULT.search(_read(module.__file__))
    except Exception:   # no modeling module of that name: no default to mirror
        return None
    return tuple(int(x) for x in found.group(1).split(",")) if found else None


_MROPE_DEFAULT = re.compile(r"""get\(\s*["']mrope_section["']\s*,\s*\[([\d,\s]+)\]""")


def _token_ids(values: dict[str, Any]) -> dict[str, Any]:
    """Every special token id moved inside the tiny vocabulary: pad, bos and eos to 0, 1, 2, the
    others (image, video, audio ... tokens) to distinct ids at the top, above what the inputs draw."""
    changes, top = {}, VOCAB - 1
    for name in sorted(values):
        value = values[name]
        if not _TOKEN_ID.fullmatch(name) or value is None or isinstance(value, (bool, str, float)):
            continue
        if name in _FIRST_IDS:
            new = _FIRST_IDS[name]
        else:
            new, top = top, top - 1
        if isinstance(value, (list, tuple)):
            changes[name] = [new] if value else value
        elif _is_int(value):
            changes[name] = new
    return changes


def _layers(values: dict[str, Any], per_layer: dict[int, dict], moe: bool) -> dict[str, Any]:
    """The layer counts, every per-layer list and index list, and the per-layer overrides of a
    heterogeneous config, for the layers :func:`_layer_plan` keeps."""
    counts = {k: values[k] for k in LAYER_COUNTS if _is_int(values.get(k)) and values[k] > 0}
    if not counts:
        return {}
    old = max(counts.values())
    keep = _layer_plan(values, per_layer, old)
    changes: dict[str, Any] = {k: min(len(keep), v) for k, v in counts.items()}
    for name, value in values.items():
        if isinstance(value, (list, tuple)) and len(value) == old and old > 1 and name not in changes:
            changes[name] = type(value)(value[i] for i in keep)
        elif _is_index_list(name, value, old):
            changes[name] = type(value)(new for new, i in enumerate(keep) if i in value)
    if per_layer:
        changes["per_layer_config"] = {new: {**per_layer[i], **_sizes(per_layer[i], moe)}
                                       for new, i in enumerate(keep) if i in per_layer}
    return changes


def tiny_config(model_type: str):
    """The config of ``model_type`` with every size shrunk (raises CannotBuild)."""
    mapping = _transformers().CONFIG_MAPPING
    if model_type not in mapping:
        raise CannotBuild(model_type, "transformers has no such model type (see tp_architectures() for those "
                                      "that ship a tensor-parallel plan)")
    cls = mapping[model_type]
    try:
        return _shrink(cls())
    except Exception as exc:
        raise CannotBuild(model_type, f"its config rejects the tiny sizes: {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# --- the model and its inputs ---------------------------------------------------------------------

def _model_class(model_type: str, config) -> tuple[Any, bool]:
    """The class a user trains with: the causal LM if the config maps to one, else the base model;
    for a config no auto class maps (a part of a composite model: its text model), the causal LM
    or model class its own modeling module declares for it. Also whether it takes ``labels``."""
    from transformers.models.auto import modeling_auto
    t = _transformers()
    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return t.AutoModelForCausalLM, True
    if model_type in modeling_auto.MODEL_MAPPING_NAMES:
        return t.AutoModel, False
    import importlib
    try:
        module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    except Exception as exc:
        raise CannotBuild(model_type, f"its modeling module does not import: {_one_line(exc)}") from exc
    own = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, t.PreTrainedModel)
           and getattr(c, "config_class", None) is type(config) and "PreTrainedModel" not in c.__name__]
    for suffix, causal in (("ForCausalLM", True), ("Model", False)):
        found = sorted((c for c in own if c.__name__.endswith(suffix)), key=lambda c: len(c.__name__))
        if found:
            return found[0], causal
    owner = _owner(type(config))
    raise CannotBuild(model_type, "no model class takes this config on its own (no auto class maps it and its "
                                  "modeling module declares none for it): it is a part of another model"
                      + (f"; build '{owner}' instead" if owner else ""))


def _owner(config_cls: type) -> str | None:
    """The model type (with a plan) whose config holds ``config_cls`` as a sub-config, at any depth."""
    mapping = _transformers().CONFIG_MAPPING

    def holds(cls: type, depth: int = 0) -> bool:
        subs = [c for c in (getattr(cls, "sub_configs", None) or {}).values() if isinstance(c, type)]
        return config_cls in subs or (depth < 2 and any(holds(c, depth + 1) for c in subs if c is not cls))
    return next((mt for mt in _tp_architectures() if mapping[mt] is not config_cls and holds(mapping[mt])), None)


def _build(cls, config, attn: str, seed: int) -> torch.nn.Module:
    """The model, every weight from ``seed``: a weight its model's initialisation leaves as
    allocated (``torch.empty``: whatever the memory held, different on every build) is drawn
    from N(0, initializer_range) instead. Allocation fills with NaN while building, so those show."""
    torch.manual_seed(seed)
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)   # makes torch.empty fill with NaN
    try:
        if hasattr(cls, "from_config"):
            model = cls.from_config(config, attn_implementation=attn, dtype=torch.float32)
        else:
            model = cls._from_config(config, attn_implementation=attn, dtype=torch.float32)
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    std = getattr(config.get_text_config(decoder=True), "initializer_range", None) or 0.02
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_floating_point() and torch.isnan(tensor).any():
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * std)
    return model


def _inputs(model: torch.nn.Module, causal: bool, seed: int) -> dict[str, torch.Tensor]:
    """Token ids [BATCH, SEQ] below the special ids (and labels for a causal LM, decoder ids for an
    encoder-decoder); for a model that reads no tokens (a vision tower), the smallest images."""
    gen = torch.Generator().manual_seed(seed)
    params = inspect.signature(model.forward).parameters
    config = model.config
    if "input_ids" not in params:
        return _image_inputs(model, params, gen)
    if getattr(config, "model_type", "") in _EMBEDS_ONLY:
        return {"inputs_embeds": torch.randn(BATCH, SEQ, HIDDEN, generator=gen)}
    ids = torch.randint(3, VOCAB - SPECIAL_IDS, (BATCH, SEQ), generator=gen)
    inputs = {"input_ids": ids}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.randint(3, VOCAB - SPECIAL_IDS, (BATCH, SEQ), generator=gen)
    if causal:
        inputs["labels"] = ids.clone()
    return inputs


#: models that take embeddings where others take token ids (their forward refuses ``input_ids``)
_EMBEDS_ONLY = {"qwen3_omni_moe_talker_code_predictor", "qwen3_omni_moe_talker_text"}


def _image_inputs(model: torch.nn.Module, params, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Images for a vision tower: BATCH images of GRID x GRID patches; flattened patches (as wide as
    its patch embedding reads) with their (time, height, width) grid for a tower that takes
    ``grid_thw``, else [BATCH, channels, side, side]."""
    config = model.config
    channels = next((_get(config, k) for k in ("num_channels", "in_channels", "in_chans")
                     if _is_int(_get(config, k))), 3)
    patch = _get(config, "patch_size") if _is_int(_get(config, "patch_size")) else 14
    first = next(iter(params))
    if "grid_thw" in params:
        embed = next((p for n, p in model.named_parameters() if "patch" in n and n.endswith("weight") and p.dim() > 1),
                     None)
        width = embed[0].numel() if embed is not None else channels * patch * patch
        grid = torch.tensor([[1, GRID, GRID]] * BATCH)
        return {first: torch.randn(BATCH * GRID * GRID, width, generator=gen), "grid_thw": grid}
    side = _get(config, "image_size") if _is_int(_get(config, "image_size")) else GRID * patch
    return {first: torch.randn(BATCH, channels, side, side, generator=gen)}


def _heads(config) -> tuple[int, int]:
    """The attention heads and key/value heads of the model's (text) decoder."""
    text = getattr(config, "get_text_config", lambda **_: config)(decoder=True)
    heads = next((_get(text, n) for n in _HEAD_NAMES if _is_int(_get(text, n))), HEADS)
    kv = next((_get(text, n) for n in _KV_NAMES if _is_int(_get(text, n))), heads)
    return heads, kv


def tiny_model(model_type: str, seed: int = 0, tp_sizes: tuple[int, ...] = (2, 4)) -> TinyModel:
    """A tiny ``model_type`` model (weights from ``torch.manual_seed(seed)``, float32, training
    mode), its inputs and its plans; raises :class:`CannotBuild` with the reason when there is
    none. One forward on the inputs is tried (its buffers restored after), so a model whose
    forward cannot run on them is refused here, not in the middle of a check."""
    config = tiny_config(model_type)
    cls, causal = _model_class(model_type, config)
    heads, kv_heads = _heads(config)
    for size in tp_sizes:
        if heads % size or kv_heads % size:
            raise CannotBuild(model_type, f"{heads} heads and {kv_heads} key/value heads do not split over "
                                          f"{size} ranks")
    errors: dict[str, str] = {}
    for attn in ("sdpa", "eager"):
        try:
            model = _build(cls, config, attn, seed)
        except Exception as exc:
            errors[attn] = _reason(exc)
            continue
        model.train()
        inputs = _inputs(model, causal, seed)
        try:
            _try_forward(model, inputs)
        except Exception as exc:
            errors[attn] = "its forward fails on the tiny inputs: " + _reason(exc)
            continue
        note = f"{type(model).__name__}, {attn} attention" + ("" if causal else "; no loss of its own (base model)")
        return TinyModel(model_type, model, inputs, dict(getattr(model, "tp_plan", {}) or {}),
                         dict(getattr(model, "ep_plan", {}) or {}), heads, kv_heads, note)
    reasons = list(dict.fromkeys(errors.values()))
    raise CannotBuild(model_type, reasons[0] if len(reasons) == 1 else
                      "; ".join(f"with {attn} attention: {why}" for attn, why in errors.items()))


def _try_forward(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    """One forward without gradients, the buffers (running statistics) put back as they were."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers and b.shape == buffers[name].shape:
                    b.copy_(buffers[name])


def _reason(exc: BaseException) -> str:
    """One line a user can act on: a missing package named as such, a forward's missing arguments
    as what it requires, else the error's own text."""
    text = _one_line(exc)
    missing = re.search(r"No module named '([\w.]+)'|requires the (\w+) library", text)
    if isinstance(exc, ImportError) or missing:
        name = next((g for g in (missing.groups() if missing else ()) if g), None)
        return f"needs the {name} package, which is not installed" if name else f"an import fails: {text}"
    absent = re.match(r"Could not find (\w+) neither in", text)
    if absent:
        return f"transformers maps this config to {absent.group(1)}, which the installed transformers does not define"
    required = re.search(r"missing \d+ required positional arguments?: (.*)", text)
    if isinstance(exc, TypeError) and required:
        return f"the model's forward requires {required.group(1)}, which a tiny model built from a config cannot supply"
    return text
