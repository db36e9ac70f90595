"""Real models for whole-model plans: small builds of HF transformers' GPT-2, Llama, BERT, ViT and
ResNet, random weights from a config (and a ConvNeXt: grouped, depthwise convolutions; a Swin:
windowed attention) (nothing is downloaded), and example inputs of the kind
each takes (token ids, pixel values). The language models are just large enough (width 64, 16
tokens, batch 4) that the solver's cheapest plan on a (2,2) mesh shards attention and the MLP,
and ViT (width 64) that it shards something on (2,2) and (4,), so their specs' strict holds:
smaller, a collective costs more than the compute it saves and the cheapest plan shards nothing.
Each also has a realistic size (:data:`REAL_MODELS`, :func:`real_size`: hidden 4096, 4096 tokens,
batch 8 by default) for the solver's costs (:mod:`shardverify.plan.real_size`): the same structure,
real sizes; the tiny builds' 8 heads split over 2, 4 or 8 devices as the real 32 do.
They cannot be symbolically traced: ``verify_plan``'s capture falls back to ``torch.export``. Needs the ``models`` extra
(``pip install -e '.[models]'``: transformers, pinned). ``lstm`` is a plain torch LSTM language model
(:class:`shardverify.plan.zoo.RecurrentLM`; transformers has no small recurrent one), whose
``aten.lstm.input`` the capture decomposes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardverify.errors import InvalidArgument
from shardverify.plan.zoo import recurrent_lm

__all__ = ["HF_MODELS", "hf_model", "REAL_MODELS", "REAL_SIZE", "real_size"]

VOCAB, SEQ, BATCH, WIDTH, HEADS = 128, 16, 4, 64, 8
#: the realistic size the solver plans for by default (``shardverify plan zoo:NAME --cost-size real``)
REAL_SIZE = {"hidden": 4096, "seq": 4096, "batch": 8}
HEAD_DIM = 128     # the real size's heads: hidden // HEAD_DIM (32 at hidden 4096, as Llama-2-7B)


def _transformers():
    try:
        import transformers
    except ImportError as exc:   # the extra is not installed
        raise InvalidArgument("the HF model zoo needs transformers: pip install -e '.[models]'") from exc
    return transformers


def _ids(seed: int, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (batch, seq), generator=gen),)


def _pixels(seed: int, batch: int = BATCH, side: int = 32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, side, side, generator=gen),)


def _short_ids(seed: int) -> tuple[torch.Tensor, ...]:
    """Token ids [16, 3] for the recurrent model: its decomposed LSTM concatenates one piece per
    step (a ``cat`` of three tensors; cat serves any number); 16 sequences so that the solver's
    cheapest plan shards."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (16, 3), generator=gen),)


def gpt2(hidden: int = WIDTH, heads: int = HEADS, vocab: int = VOCAB, positions: int = 32) -> torch.nn.Module:
    t = _transformers()
    # GPT-2's special ids (50256) lie outside a tiny vocabulary: the last id of this one, as GPT-2's is of its
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=1, n_head=heads,
                                          n_positions=positions, attn_implementation="sdpa", use_cache=False,
                                          bos_token_id=vocab - 1, eos_token_id=vocab - 1))


def llama(hidden: int = WIDTH, heads: int = HEADS, ffn: int = 2 * WIDTH, vocab: int = VOCAB,
          positions: int = 32) -> torch.nn.Module:
    t = _transformers()
    return t.LlamaForCausalLM(t.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                            num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
                                            max_position_embeddings=positions, attn_implementation="sdpa",
                                            use_cache=False))


def bert(hidden: int = WIDTH, heads: int = HEADS, ffn: int = 2 * WIDTH, vocab: int = VOCAB,
         positions: int = 32) -> torch.nn.Module:
    t = _transformers()
    return t.BertModel(t.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
                                    intermediate_size=ffn, max_position_embeddings=positions,
                                    attn_implementation="sdpa"), add_pooling_layer=False)


def vit(hidden: int = WIDTH, heads: int = HEADS, ffn: int = 2 * WIDTH, image: int = 32, patch: int = 8,
        labels: int = 10) -> torch.nn.Module:
    t = _transformers()
    return t.ViTForImageClassification(t.ViTConfig(image_size=image, patch_size=patch, hidden_size=hidden,
                                                   num_hidden_layers=1, num_attention_heads=heads,
                                                   intermediate_size=ffn, num_labels=labels,
                                                   attn_implementation="sdpa"))


def resnet(stem: int = 8, widths: tuple[int, int] = (8, 16), labels: int = 10) -> torch.nn.Module:
    t = _transformers()
    return t.ResNetForImageClassification(t.ResNetConfig(embedding_size=stem, hidden_sizes=list(widths), depths=[1, 1],
                                                         layer_type="basic", num_labels=labels))


def _side(seq: int, what: str) -> int:
    side = int(round(seq ** 0.5))
    if side * side != seq:
        raise InvalidArgument(f"{what}: seq={seq} must be a square (the image is side x side)")
    return side


# The same models at a size they train at: the tiny build's structure (one layer, the same options),
# the sizes of a real configuration: heads of HEAD_DIM, Llama's SwiGLU width (8h/3 rounded up to 256:
# 11008 at 4096), 4h MLPs, position tables twice the sequence (as the tiny build's 32 for 16 tokens), the real vocabularies (GPT-2's 50257 splits unevenly over 2, 4 or 8: the
# plan then leaves the vocabulary unsharded, and says so), ViT's 16-pixel patches (seq patches), a
# ResNet whose stem and stages are hidden/2, hidden/2 and hidden channels (the tiny build's 8, 8, 16: a first
# stage without a shortcut convolution) on a sqrt(seq) x sqrt(seq) image.
# Built on the meta device (real_size.capture_real): the inputs' values are never read, only their shapes.
def _gpt2_real(hidden: int, seq: int, batch: int):
    return gpt2(hidden, hidden // HEAD_DIM, 50257, 2 * seq), (torch.zeros(batch, seq, dtype=torch.int64),)


def _llama_real(hidden: int, seq: int, batch: int):
    ffn = 256 * -(-int(8 * hidden / 3) // 256)
    return llama(hidden, hidden // HEAD_DIM, ffn, 32000, 2 * seq), (torch.zeros(batch, seq, dtype=torch.int64),)


def _bert_real(hidden: int, seq: int, batch: int):
    return bert(hidden, hidden // HEAD_DIM, 4 * hidden, 30522, 2 * seq), (torch.zeros(batch, seq, dtype=torch.int64),)


def _vit_real(hidden: int, seq: int, batch: int):
    side = 16 * _side(seq, "vit")
    return vit(hidden, hidden // HEAD_DIM, 4 * hidden, side, 16, 1000), (torch.zeros(batch, 3, side, side),)


def _resnet_real(hidden: int, seq: int, batch: int):
    side = _side(seq, "resnet")
    return resnet(hidden // 2, (hidden // 2, hidden), 1000), (torch.zeros(batch, 3, side, side),)


def mixtral(hidden: int = WIDTH, heads: int = 4, ffn: int = 2 * WIDTH, vocab: int = VOCAB, positions: int = 32,
            experts: int = 4) -> torch.nn.Module:
    """A mixture-of-experts LM: a top-2 router over 4 experts, their stacked weights ([4, 256, 64]
    and [4, 64, 128]) applied in transformers' ``batched_mm`` implementation (each token copied once
    per chosen expert, its expert's weights looked up by id, a ``bmm``): every op an ATen op with a
    spec. The default on CPU, ``grouped_mm``, runs the grouped matmul in transformers' own custom op
    (``torch.ops.transformers.grouped_mm_fallback``, a loop over the experts' row blocks), which no
    spec can name without transformers installed to load it."""
    t = _transformers()
    return t.MixtralForCausalLM(t.MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                                num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
                                                num_local_experts=experts, num_experts_per_tok=2,
                                                max_position_embeddings=positions,
                                                attn_implementation="sdpa", experts_implementation="batched_mm",
                                                use_cache=False))


def mixtral_capacity(hidden: int = WIDTH, heads: int = HEADS, ffn: int = 2 * WIDTH, vocab: int = VOCAB,
                     positions: int = 32, experts: int = 8, groups: int = 16, capacity: int = SEQ) -> torch.nn.Module:
    """HF Mixtral (top-2 of 8 experts) with its experts run by :mod:`shardverify.plan.hf_experts`:
    the tokens of each of ``groups`` groups (a sequence each) routed into ``capacity`` slots per
    expert, the experts' stacked weights applied with the expert dim shared by tokens and weights,
    so that splitting the experts over a mesh axis (expert parallelism) is a layout. The tiny
    build's capacity is a whole sequence: no token dropped, transformers' own function to rounding."""
    from shardverify.plan import hf_experts

    t = _transformers()
    hf_experts.register()
    config = t.MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=1,
                             num_attention_heads=heads, num_key_value_heads=heads, num_local_experts=experts,
                             num_experts_per_tok=2, max_position_embeddings=positions, attn_implementation="sdpa",
                             experts_implementation=hf_experts.NAME, use_cache=False)
    return hf_experts.add_slots(t.MixtralForCausalLM(config), groups, capacity)


def _ids_16(seed: int) -> tuple[torch.Tensor, ...]:
    """Token ids [16, 16]: 16 sequences, a group each, which splits over 8 or 16 devices evenly as a
    real batch of 8 or 16 does."""
    return _ids(seed, batch=16)


class _EncoderDecoder(torch.nn.Module):
    """An encoder-decoder model called with the encoder's and the decoder's ids (the decoder's given,
    as in training with teacher forcing, rather than shifted from the encoder's in place)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor):
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids)


def _two_ids(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(2))


def bart(hidden: int = WIDTH, heads: int = 4, ffn: int = 2 * WIDTH, vocab: int = VOCAB,
         positions: int = 32) -> torch.nn.Module:
    """An encoder-decoder: the decoder's self-attention is causal, its cross-attention reads the
    encoder's output."""
    t = _transformers()
    return _EncoderDecoder(t.BartModel(t.BartConfig(vocab_size=vocab, d_model=hidden, encoder_layers=1, decoder_layers=1,
                                    encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                                    decoder_ffn_dim=ffn, max_position_embeddings=positions, use_cache=False,
                                    attn_implementation="sdpa")))


def convnext(widths: tuple[int, int] = (16, 32), labels: int = 10) -> torch.nn.Module:
    """A grouped-convolution vision net: 4x4 patchify conv, then ConvNeXt blocks (depthwise 7x7 conv,
    layer norm, Linear-GELU-Linear MLP, layer scale, residual), mean-pooled into a classifier."""
    t = _transformers()
    return t.ConvNextForImageClassification(t.ConvNextConfig(num_channels=3, patch_size=2, hidden_sizes=list(widths),
                                                             num_stages=2, depths=[1, 1], num_labels=labels))


def swin(width: int = 32, heads: tuple[int, ...] = (8,), depths: tuple[int, ...] = (2,), image: int = 28,
         patch: int = 2, window: int = 4, labels: int = 10, mlp_ratio: float = 2.0) -> torch.nn.Module:
    """A windowed-attention vision transformer: 2x2 patches (14x14 of them, padded to 16x16 for 4x4
    windows and cropped back after each block), two Swin blocks, the second's windows shifted by half
    a window (a ``roll`` each way and an attention mask built from the shifted regions), attention
    within each window with a relative-position bias looked up from a table (an ``index``), mean-pooled
    into a classifier. One stage: the second stage's patch merging (strided slices, a ``cat`` of
    four) doubles the graph and the solver's time; ``depths=(2, 1), heads=(8, 16)`` builds it. Width 32
    and 8 heads: at width 16 the solver's cheapest plan on (4,) shards nothing."""
    t = _transformers()
    config = t.SwinConfig(image_size=image, patch_size=patch, num_channels=3, embed_dim=width, depths=list(depths),
                          num_heads=list(heads), window_size=window, mlp_ratio=mlp_ratio, num_labels=labels)
    return t.SwinForImageClassification(config)


def _pixels_28(seed: int) -> tuple[torch.Tensor, ...]:
    """Pixels [4, 3, 28, 28] for Swin: 14x14 patches, which 4x4 windows do not tile (padded)."""
    return _pixels(seed, side=28)


#: name -> (model factory, example inputs for a seed)
HF_MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], tuple[torch.Tensor, ...]]]] = {
    "gpt2": (gpt2, _ids), "llama": (llama, _ids), "bert": (bert, _ids), "vit": (vit, _pixels),
    "resnet": (resnet, _pixels),
    "lstm": (recurrent_lm, _short_ids),      # a plain torch LSTM language model (shardverify.plan.zoo)
    "mixtral": (mixtral, _ids),
    "mixtral-capacity": (mixtral_capacity, _ids_16),
    "bart": (bart, _two_ids),
    "convnext": (convnext, _pixels),
    "swin": (swin, _pixels_28),
}


#: name -> (hidden, seq, batch) -> (the model at that size, its inputs): built under a FakeTensorMode
#: by :mod:`shardverify.plan.real_size`, so no weight is allocated. A zoo model without one is
#: planned with the tiny build's own costs only.
def _mixtral_real(hidden: int, seq: int, batch: int):
    # Mixtral-8x7B's 8 experts and its MLP width (3.5h); its keys and values keep every head (the
    # real model shares 8 among 32: grouped-query attention adds ops the tiny build's graph lacks)
    return mixtral(hidden, hidden // HEAD_DIM, 7 * hidden // 2, 32000, 2 * seq, 8), \
        (torch.zeros(batch, seq, dtype=torch.int64),)


def _mixtral_capacity_real(hidden: int, seq: int, batch: int):
    # Mixtral-8x7B's experts and MLP width; a sequence per group and GShard's capacity: 1.25 times
    # a group's even share of the top-2 choices (k * seq / experts), tokens past it dropped
    capacity = -(-5 * 2 * seq // (4 * 8))
    return mixtral_capacity(hidden, hidden // HEAD_DIM, 7 * hidden // 2, 32000, 2 * seq, 8, batch, capacity), \
        (torch.zeros(batch, seq, dtype=torch.int64),)


def _bart_real(hidden: int, seq: int, batch: int):
    ids = torch.zeros(batch, seq, dtype=torch.int64)
    return bart(hidden, hidden // HEAD_DIM, 4 * hidden, 50265, 2 * seq), (ids, ids.clone())


def _convnext_real(hidden: int, seq: int, batch: int):
    side = 2 * _side(seq, "convnext")     # patches of 2: seq patches
    return convnext((hidden // 2, hidden), 1000), (torch.zeros(batch, 3, side, side),)


def _swin_real(hidden: int, seq: int, batch: int):
    # Swin's 4-pixel patches and 7x7 windows (the tiny build's 4x4 ones scaled as Swin-T's are), a 4h MLP
    side = _side(seq, "swin")
    if side % 7 == 0 or side <= 7:
        raise InvalidArgument(f"swin: seq={seq} gives {side}x{side} patches, which 7x7 windows "
                              f"{'tile exactly' if side > 7 else 'cannot shift over'}; the tiny build pads its "
                              f"14x14 patches to whole windows and shifts them, and a real size must do the same: "
                              f"a seq whose side is over 7 and not a multiple of 7 (4096: 64x64)")
    model = swin(hidden, (hidden // HEAD_DIM,), (2,), 4 * side, 4, 7, 1000, 4.0)
    return model, (torch.zeros(batch, 3, 4 * side, 4 * side),)


REAL_MODELS: dict[str, Callable[[int, int, int], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]] = {
    "gpt2": _gpt2_real, "llama": _llama_real, "bert": _bert_real, "vit": _vit_real, "resnet": _resnet_real,
    "mixtral": _mixtral_real, "mixtral-capacity": _mixtral_capacity_real, "bart": _bart_real, "convnext": _convnext_real, "swin": _swin_real,
}


def real_size(name: str, sizes: dict[str, int] | None = None, dtype: str | None = None):
    """The zoo model ``name`` at a real size, as a :class:`~shardverify.plan.real_size.RealSize`:
    ``sizes`` (hidden, seq, batch) over :data:`REAL_SIZE`, trained in ``dtype`` (float32 when None)."""
    from shardverify.plan.real_size import RealSize

    if name not in REAL_MODELS:
        raise InvalidArgument(f"zoo model {name!r} declares no real size; the ones that do are "
                              f"{', '.join(REAL_MODELS)}")
    unknown = sorted(set(sizes or {}) - set(REAL_SIZE))
    if unknown:
        raise InvalidArgument(f"unknown size(s) {unknown}: a zoo model's real size takes {', '.join(REAL_SIZE)}")
    dims = {**REAL_SIZE, **(sizes or {})}
    bad = [f"{k}={v}" for k, v in dims.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
    if bad:
        raise InvalidArgument(f"real sizes are positive integers, got {', '.join(bad)}")
    if dims["hidden"] % HEAD_DIM:
        raise InvalidArgument(f"hidden={dims['hidden']} must be a multiple of {HEAD_DIM} (the real size's heads are "
                              f"{HEAD_DIM} wide)")
    label = ", ".join(f"{k}={v}" for k, v in dims.items()) + (f", {dtype}" if dtype else "")
    return RealSize(lambda: REAL_MODELS[name](dims["hidden"], dims["seq"], dims["batch"]), f"zoo:{name} at {label}",
                    getattr(torch, dtype or "float32"))


def hf_model(name: str, seed: int = 0) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The model ``name`` in eval mode (dropout off, batch norm on its running statistics) with
    seeded weights, and its example inputs."""
    if name not in HF_MODELS:
        raise InvalidArgument(f"no zoo model {name!r}; the zoo has {', '.join(HF_MODELS)}")
    factory, inputs = HF_MODELS[name]
    torch.manual_seed(seed)
    return factory().eval(), inputs(seed)
