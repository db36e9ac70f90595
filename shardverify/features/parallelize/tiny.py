"""Tiny, randomly initialised transformers models for every architecture whose config ships a
tensor-parallel plan (``base_model_tp_plan``), so the plan transformers itself applies
(``maybe_distribute_model``) can be run on 2 and 4 ranks against the single-device model.

Nothing is downloaded (no hub access, no tokenizer): each model is built with ``from_config`` from
its config class's defaults with every size shrunk (shrunk_config.py says to what and why; which
architectures ship a plan: architectures.py). Dropout is off and the weights come from
``torch.manual_seed(seed)``; train/eval mode is the caller's. A model whose forward cannot run on
its tiny inputs is refused (:class:`CannotBuild`, one line saying why) before any check starts.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch

from shardverify.features.parallelize.architectures import import_transformers, tp_architectures
from shardverify.features.parallelize.shrunk_config import (BATCH, FFN, GRID, HEAD_DIM, HEAD_NAMES, HEADS, HIDDEN, KV_HEADS,
                                                   KV_NAMES, LAYERS, MAX_LAYERS, SEQ, SPECIAL_IDS, VOCAB,
                                                   CannotBuild, config_value, is_int, one_line, tiny_config)

__all__ = ["CannotBuild", "TinyModel", "tiny_model", "tp_architectures", "tiny_config",
           "BATCH", "SEQ", "HIDDEN", "FFN", "LAYERS", "HEADS", "KV_HEADS", "HEAD_DIM", "VOCAB", "MAX_LAYERS"]


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


def _model_class(model_type: str, config) -> tuple[Any, bool]:
    """The class a user trains with: the causal LM if the config maps to one, else the base model;
    for a config no auto class maps (a part of a composite model: its text model), the causal LM
    or model class its own modeling module declares for it. Also whether it takes ``labels``."""
    from transformers.models.auto import modeling_auto
    t = import_transformers()
    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return t.AutoModelForCausalLM, True
    if model_type in modeling_auto.MODEL_MAPPING_NAMES:
        return t.AutoModel, False
    import importlib
    try:
        module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    except Exception as exc:
        raise CannotBuild(model_type, f"its modeling module does not import: {one_line(exc)}") from exc
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
    mapping = import_transformers().CONFIG_MAPPING

    def holds(cls: type, depth: int = 0) -> bool:
        subs = [c for c in (getattr(cls, "sub_configs", None) or {}).values() if isinstance(c, type)]
        return config_cls in subs or (depth < 2 and any(holds(c, depth + 1) for c in subs if c is not cls))
    return next((mt for mt in tp_architectures() if mapping[mt] is not config_cls and holds(mapping[mt])), None)


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
    channels = next((config_value(config, k) for k in ("num_channels", "in_channels", "in_chans")
                     if is_int(config_value(config, k))), 3)
    patch = config_value(config, "patch_size") if is_int(config_value(config, "patch_size")) else 14
    first = next(iter(params))
    if "grid_thw" in params:
        embed = next((p for n, p in model.named_parameters() if "patch" in n and n.endswith("weight") and p.dim() > 1),
                     None)
        width = embed[0].numel() if embed is not None else channels * patch * patch
        grid = torch.tensor([[1, GRID, GRID]] * BATCH)
        return {first: torch.randn(BATCH * GRID * GRID, width, generator=gen), "grid_thw": grid}
    side = config_value(config, "image_size") if is_int(config_value(config, "image_size")) else GRID * patch
    return {first: torch.randn(BATCH, channels, side, side, generator=gen)}


def _heads(config) -> tuple[int, int]:
    """The attention heads and key/value heads of the model's (text) decoder."""
    text = getattr(config, "get_text_config", lambda **_: config)(decoder=True)
    heads = next((config_value(text, n) for n in HEAD_NAMES if is_int(config_value(text, n))), HEADS)
    kv = next((config_value(text, n) for n in KV_NAMES if is_int(config_value(text, n))), heads)
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
    text = one_line(exc)
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
