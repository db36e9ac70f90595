"""Real models for whole-model plans: small builds of HF transformers' GPT-2, Llama, BERT, ViT and
ResNet, random weights from a config (and a ConvNeXt: grouped, depthwise convolutions) (nothing is downloaded), and example inputs of the kind
each takes (token ids, pixel values). The language models are just large enough (width 64, 16
tokens, batch 4) that the solver's cheapest plan on a (2,2) mesh shards attention and the MLP,
and ViT (width 64) that it shards something on (2,2) and (4,), so their specs' strict holds:
smaller, a collective costs more than the compute it saves and the cheapest plan shards nothing.
They cannot be symbolically traced: ``verify_plan``'s capture falls back to ``torch.export``. Needs the ``models`` extra
(``pip install -e '.[models]'``: transformers, pinned).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardverify.errors import InvalidArgument

__all__ = ["HF_MODELS", "hf_model"]

VOCAB, SEQ, BATCH, WIDTH = 128, 16, 4, 64


def _transformers():
    try:
        import transformers
    except ImportError as exc:   # the extra is not installed
        raise InvalidArgument("the HF model zoo needs transformers: pip install -e '.[models]'") from exc
    return transformers


def _ids(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),)


def _pixels(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, 3, 32, 32, generator=gen),)


def gpt2() -> torch.nn.Module:
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_layer=1, n_head=4, n_positions=32,
                                          attn_implementation="sdpa", use_cache=False))


def llama() -> torch.nn.Module:
    t = _transformers()
    return t.LlamaForCausalLM(t.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                                            max_position_embeddings=32, attn_implementation="sdpa", use_cache=False))


def bert() -> torch.nn.Module:
    t = _transformers()
    return t.BertModel(t.BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=4,
                                    intermediate_size=2 * WIDTH, max_position_embeddings=32, attn_implementation="sdpa"),
                       add_pooling_layer=False)


def vit() -> torch.nn.Module:
    t = _transformers()
    return t.ViTForImageClassification(t.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=1,
                                                   num_attention_heads=4, intermediate_size=128, num_labels=10,
                                                   attn_implementation="sdpa"))


def resnet() -> torch.nn.Module:
    t = _transformers()
    return t.ResNetForImageClassification(t.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                         layer_type="basic", num_labels=10))


def convnext() -> torch.nn.Module:
    """A grouped-convolution vision net: 4x4 patchify conv, then ConvNeXt blocks (depthwise 7x7 conv,
    layer norm, Linear-GELU-Linear MLP, layer scale, residual), mean-pooled into a classifier."""
    t = _transformers()
    return t.ConvNextForImageClassification(t.ConvNextConfig(num_channels=3, patch_size=2, hidden_sizes=[16, 32], num_stages=2,
                                                             depths=[1, 1], num_labels=10))


#: name -> (model factory, example inputs for a seed)
HF_MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], tuple[torch.Tensor, ...]]]] = {
    "gpt2": (gpt2, _ids), "llama": (llama, _ids), "bert": (bert, _ids), "vit": (vit, _pixels),
    "resnet": (resnet, _pixels),
    "convnext": (convnext, _pixels),
}


def hf_model(name: str, seed: int = 0) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The model ``name`` in eval mode (dropout off, batch norm on its running statistics) with
    seeded weights, and its example inputs."""
    if name not in HF_MODELS:
        raise InvalidArgument(f"no zoo model {name!r}; the zoo has {', '.join(HF_MODELS)}")
    factory, inputs = HF_MODELS[name]
    torch.manual_seed(seed)
    return factory().eval(), inputs(seed)
