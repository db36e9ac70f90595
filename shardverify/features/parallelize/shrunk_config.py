"""The config of a tiny transformers model: every size a config (and each sub-config) has shrunk,
whatever the config calls it.

The sizes are chosen so that 2 and 4 ranks divide what a plan shards: 4 attention heads and 4
key/value heads of 16 (hidden 64), MLP widths 128, 4 experts (2 per token, widths 32), MLA ranks
32, state-space mixers of 4 heads, a vocabulary of 256 with every special token id inside it (the
inputs draw below them, so a text-only batch holds no image token), 128 positions. Two layers, or
one of each kind where the config mixes kinds (sliding and full attention, dense and MoE,
attention and linear or state-space mixers; at most four), the first layer dense where the config
has dense-first MoE, so that every rule of the plan finds a module. Where the defaults leave a size
to the checkpoint (None) or are inconsistent for a small model, :data:`_FIXES` says what a
checkpoint's config would. Dropout is off. A config that rejects the tiny sizes is refused
(:class:`CannotBuild`, one line saying why).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

from shardverify.errors import InvalidArgument
from shardverify.features.parallelize.architectures import import_transformers, read_source

__all__ = ["CannotBuild", "tiny_config", "config_value", "is_int", "one_line", "SIZES", "HEAD_NAMES", "KV_NAMES",
           "BATCH", "SEQ", "GRID", "HIDDEN", "FFN", "LAYERS", "HEADS", "KV_HEADS", "HEAD_DIM", "VOCAB", "POSITIONS",
           "EXPERTS", "EXPERTS_PER_TOKEN", "EXPERT_FFN", "CHANNELS", "MAX_LAYERS", "SPECIAL_IDS"]

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
HEAD_NAMES = next(names for value, names in _SIZES if "num_attention_heads" in names)
KV_NAMES = next(names for value, names in _SIZES if "num_key_value_heads" in names)
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers", "encoder_layers",
                "decoder_layers", "num_encoder_layers", "depth", "num_layers_per_stack")
_LAYER_COUNT_SET = set(LAYER_COUNTS)
#: how many of the first layers are dense (the rest MoE): one, so both kinds are built
_DENSE_FIRST = ("first_k_dense_replace", "num_dense_layers")
#: layers below this index use full attention, above it sliding windows
_WINDOW_LAYERS = ("max_window_layers",)
_TOKEN_ID = re.compile(r".*token_ids?$|.*token_index$|.*_token$")
_FIRST_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}


def config_value(config, name: str, default=None):
    """A config attribute, per-layer ones of a heterogeneous config too (their global value)."""
    read = getattr(config, "_getattr_without_heterogeneous_validation", None)
    return read(name, default) if read else getattr(config, name, default)


def _fields(config) -> dict[str, Any]:
    """The init fields of a (dataclass) config with their current values."""
    missing = object()
    values = {f.name: config_value(config, f.name, missing) for f in dataclasses.fields(config) if f.init}
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


def is_int(value) -> bool:
    """An int that is not a bool."""
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
        if name not in SIZES and _CHANNELS.fullmatch(name) and not (is_int(value) and value > CHANNELS) \
                and not isinstance(value, (list, tuple)):
            continue   # image channels (3), or already small
        if tiny is not None and ((is_int(value) and value > 0) or (value is None and (
                name in _EVEN_IF_NONE or (moe and name in _MOE_SIZES)))):
            changes[name] = tiny
        elif tiny is not None and isinstance(value, (list, tuple)) and value and all(is_int(v) for v in value) \
                and name not in _LAYER_COUNT_SET:
            changes[name] = type(value)(tiny for _ in value)     # one size per layer (or stage)
        elif name == "rotary_dim" and is_int(value):
            changes[name] = HEAD_DIM // 2
        elif ("dropout" in name or "pdrop" in name or name.endswith("drop_rate") or name == "layerdrop"
              or "jitter" in name) and isinstance(value, float):
            changes[name] = 0.0     # no randomness in a training step: dropout, router jitter
        elif name in _WINDOWS and is_int(value) and value > 8:
            changes[name] = 8
    hidden = values.get("hidden_size")
    for name, value in values.items():   # a width that must equal the hidden size (adapters, codebooks)
        if name not in changes and is_int(hidden) and hidden > HIDDEN and value == hidden \
                and re.search(r"dim|size", name) and name not in _LAYER_COUNT_SET:
            changes[name] = HIDDEN
    if is_int(values.get("head_dim")) and values.get("head_dim") == values.get("qk_rope_head_dim") \
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
        if isinstance(section, (list, tuple)) and section and all(is_int(x) for x in section) and sum(section):
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
            changes[name] = _shrink(import_transformers().CONFIG_MAPPING[value["model_type"]](**value))
        elif name == "use_cache":
            changes[name] = False
    changes.update(_token_ids(values))
    changes.update(_layers({**values, **changes}, per_layer, moe))
    new_layers = next((changes[k] for k in LAYER_COUNTS if k in changes), LAYERS)
    for name in _DENSE_FIRST:
        if is_int(values.get(name)):
            changes[name] = 1
    for name in _WINDOW_LAYERS:
        if is_int(values.get(name)):
            changes[name] = min(values[name], new_layers)
    if "qk_head_dim" in values and "qk_nope_head_dim" in changes and "qk_rope_head_dim" in changes:
        changes["qk_head_dim"] = changes["qk_nope_head_dim"] + changes["qk_rope_head_dim"]
    layer_types = changes.get("layer_types", values.get("layer_types")) or ()
    if "sliding_window" in values and values["sliding_window"] is None \
            and any("sliding" in str(kind) for kind in layer_types):
        changes["sliding_window"] = 8
    changes.update(_mamba(values))
    patch = changes.get("patch_size", values.get("patch_size"))
    if is_int(patch) and is_int(values.get("image_size")) and values["image_size"] > GRID * patch:
        changes["image_size"] = GRID * patch    # a vision tower's images: GRID x GRID patches
    if "mlp_only_layers" in values and isinstance(values["mlp_only_layers"], (list, tuple)):
        changes["mlp_only_layers"] = [0]        # a dense layer, then MoE: the plan's rules for both apply
    kinds = changes.get("mlp_layer_types")
    if isinstance(kinds, list) and "sparse" in kinds and "dense" not in kinds and len(kinds) > 1:
        changes["mlp_layer_types"] = ["dense", *kinds[1:]]    # likewise where the config lists the kinds
    if is_int(values.get("prefix_dense_intermediate_size")) or "prefix_dense_intermediate_size" in values:
        changes["prefix_dense_intermediate_size"] = FFN
    if is_int(values.get("num_kv_shared_layers")):
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
    expand = next((values[k] for k in ("mamba_expand", "expand") if is_int(values.get(k))), 2)
    inner = expand * HIDDEN
    for name, value in values.items():
        if not is_int(value) or value <= 0:
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
        found = _MROPE_DEFAULT.search(read_source(module.__file__))
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
        elif is_int(value):
            changes[name] = new
    return changes


def _layers(values: dict[str, Any], per_layer: dict[int, dict], moe: bool) -> dict[str, Any]:
    """The layer counts, every per-layer list and index list, and the per-layer overrides of a
    heterogeneous config, for the layers :func:`_layer_plan` keeps."""
    counts = {k: values[k] for k in LAYER_COUNTS if is_int(values.get(k)) and values[k] > 0}
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
    mapping = import_transformers().CONFIG_MAPPING
    if model_type not in mapping:
        raise CannotBuild(model_type, "transformers has no such model type (see tp_architectures() for those "
                                      "that ship a tensor-parallel plan)")
    cls = mapping[model_type]
    try:
        return _shrink(cls())
    except Exception as exc:
        raise CannotBuild(model_type, f"its config rejects the tiny sizes: {one_line(exc)}") from exc


def one_line(exc: BaseException) -> str:
    """An error's text on one line, at most 300 characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
