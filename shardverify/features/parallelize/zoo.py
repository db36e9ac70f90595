"""Models and plans people ship, written small: the Colwise + Rowwise MLP of PyTorch's "Incorrect
Results with Tensor Parallelism" report, and a Llama in torchtitan's layout (``tok_embeddings``,
``layers.N.attention.wq/wk/wv/wo``, ``feed_forward.w1/w2/w3``, RMSNorms, ``output``) with
torchtitan's parallelize: tensor parallel, sequence parallel norms, loss parallel, and FSDP2 over a
``dp`` axis. The titan plan also comes with one mistake planted at a time (``titan-swapped`` ...),
the ones people make: the checker must catch each and blame the right module."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardverify.errors import InvalidArgument
from shardverify.features.parallelize.models import Batch, ModelSource
from shardverify.features.parallelize.plans import Plan, function_plan, styles_plan

__all__ = ["zoo_model", "zoo_plan", "ZOO_MODELS", "ZOO_PLANS", "TitanLlama", "titan_parallelize", "PLANTS"]


class MLP(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 32):
        super().__init__()
        self.w1, self.w2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class ScanMLP(MLP):
    """An MLP whose hidden activation is a running sum over its features (``cumsum(h, -1)``): under a
    plan that leaves the hidden layer a feature-sharded DTensor, DTensor's cumsum of a negative dim
    runs per shard (docs/upstream/cumsum-negative-dim.md) and the plan is silently wrong."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.cumsum(torch.relu(self.w1(x)), -1) / self.w1.out_features)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of [batch, seq, heads, head_dim] by position in the sequence."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs).to(x.dtype)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = _rotate(q), _rotate(k)
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.feed_forward = RMSNorm(dim), FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    """torchtitan's Llama layout at a tiny size (4 heads, so 2 and 4 ranks divide them)."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, hidden: int = 64, layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm, self.output = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


#: mistakes people make in a tensor/sequence-parallel plan, planted one at a time
PLANTS = {
    "norm-left-out": "ffn_norm left out of sequence parallel (its weight's gradient is each rank's part, never summed)",
    "local-output-flipped": "attention.wo with use_local_output=False (a DTensor where a local tensor is expected)",
    "wrong-input-layouts": "tok_embeddings' output replicated where the sequence-parallel norms take sequence shards",
    "embedding-wrong-dim": "tok_embeddings sharded on the embedding dim (Colwise) where the norms take sequence shards",
}


def titan_parallelize(model: TitanLlama, mesh, plant: str = "") -> TitanLlama:
    """torchtitan's ``apply_tp`` (TP + sequence parallel + loss parallel output) on ``mesh["tp"]``,
    then FSDP2 ``fully_shard`` on ``mesh["dp"]`` when the mesh has one; ``plant`` one of :data:`PLANTS`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tp = mesh["tp"]
    if plant == "embedding-wrong-dim":
        embedding = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))
    else:
        embedding = RowwiseParallel(input_layouts=Replicate(),
                                    output_layouts=Replicate() if plant == "wrong-input-layouts" else Shard(1))
    parallelize_module(model, tp, {
        "tok_embeddings": embedding,
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=plant != "local-output-flipped"),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        if plant == "norm-left-out":
            del plan["ffn_norm"]
        parallelize_module(block, tp, plan)
    if "dp" in (mesh.mesh_dim_names or ()):
        from torch.distributed.fsdp import fully_shard
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def _tokens(step: int, vocab: int, batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(100 + step))


def _mlp_source(name: str, cls: type[MLP]) -> ModelSource:
    """An MLP of ``cls`` on batches of 8 rows of 16 features."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return cls()

    def batch(step: int) -> Batch:
        return Batch({"x": torch.randn(8, 16, generator=torch.Generator().manual_seed(step))})

    return ModelSource(name, build, batch)


def _titan(seed: int) -> ModelSource:
    vocab = 64

    def build() -> nn.Module:
        torch.manual_seed(seed)
        return TitanLlama(vocab)

    def batch(step: int) -> Batch:
        return Batch({"tokens": _tokens(step, vocab)}, _tokens(step + 50, vocab))

    return ModelSource("zoo:titan_llama", build, batch, heads=4)


ZOO_MODELS = {"mlp": lambda seed: _mlp_source("zoo:mlp", MLP), "scan_mlp": lambda seed: _mlp_source("zoo:scan_mlp", ScanMLP),
              "titan_llama": _titan}


def zoo_model(name: str, seed: int = 0) -> ModelSource:
    if name not in ZOO_MODELS:
        raise InvalidArgument(f"no zoo model {name!r}; the zoo has {', '.join(ZOO_MODELS)}")
    return ZOO_MODELS[name](seed)


def _mlp_plan(swapped: bool = False) -> Plan:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    first, second = (RowwiseParallel, ColwiseParallel) if swapped else (ColwiseParallel, RowwiseParallel)
    return styles_plan({"w1": first(), "w2": second()}, "mlp-swapped" if swapped else "mlp")


def _dtensor_hidden_plan() -> Plan:
    """Colwise w1 keeping its output a DTensor (use_local_output=False), Rowwise w2 taking it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return styles_plan({"w1": ColwiseParallel(use_local_output=False), "w2": RowwiseParallel()}, "mlp-dtensor-hidden")


def _titan_plan(plant: str = "") -> Plan:
    def apply(model, mesh):
        return titan_parallelize(model, mesh, plant)
    return function_plan(apply, "titan" + (f"-{plant}" if plant else ""), loss_parallel=True)


ZOO_PLANS = {"mlp": _mlp_plan, "mlp-swapped": lambda: _mlp_plan(True), "mlp-dtensor-hidden": _dtensor_hidden_plan,
             "titan": _titan_plan,
             **{f"titan-{plant}": (lambda p=plant: _titan_plan(p)) for plant in PLANTS}}


def zoo_plan(name: str) -> Plan:
    if name not in ZOO_PLANS:
        raise InvalidArgument(f"no zoo plan {name!r}; the zoo has {', '.join(ZOO_PLANS)}")
    return ZOO_PLANS[name]()
