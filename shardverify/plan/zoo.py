"""Small models the shipped plan specs use (factories named by dotted path in specs/plans)."""

from __future__ import annotations

import torch
from torch import nn


class LinearChain(nn.Module):
    """Linear-Linear: a two-layer MLP without an activation (handlers for linear only)."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


class MLPBlock(nn.Module):
    """Linear-GELU-Linear."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_in, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def linear_chain(d_in: int = 32, d_hidden: int = 64, d_out: int = 32) -> nn.Module:
    return LinearChain(d_in, d_hidden, d_out)


def mlp_block(d_in: int = 32, d_hidden: int = 64) -> nn.Module:
    return MLPBlock(d_in, d_hidden)


class TransformerBlock(nn.Module):
    """Pre-norm block: LayerNorm, multi-head attention written with matmul/softmax, a residual
    add, LayerNorm, Linear-GELU-Linear, a residual add. The projections that end a parallel
    region (out, fc2) have no bias, so row-parallel strategies apply to them."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, d_hidden: int = 64) -> None:
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_model, bias=False)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.reshape(b, s, self.n_heads, self.d_head).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        h = self.ln1(x)
        q, k, v = self._heads(self.q(h)), self._heads(self.k(h)), self._heads(self.v(h))
        scores = torch.matmul(q, k.transpose(-2, -1)) / (self.d_head ** 0.5)
        attn = torch.matmul(torch.softmax(scores, dim=-1), v)
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, c))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class SmallCNN(nn.Module):
    """Conv-ReLU-MaxPool-Flatten-Linear."""

    def __init__(self, channels: int = 8, classes: int = 16, size: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(channels * (size // 2) ** 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.pool(self.relu(self.conv(x)))))


def transformer_block(d_model: int = 32, n_heads: int = 4, d_hidden: int = 64) -> nn.Module:
    return TransformerBlock(d_model, n_heads, d_hidden)


def small_cnn(channels: int = 8, classes: int = 16, size: int = 8) -> nn.Module:
    return SmallCNN(channels, classes, size)


class RecurrentLM(nn.Module):
    """A recurrent language model: token embedding, an LSTM (batch first), a linear head. The
    exported ``aten.lstm.input`` has no spec: it is decomposed into its cell's core ops
    (linear, sigmoid, tanh, mul, add, slices) and those are planned and verified."""

    def __init__(self, vocab: int = 128, width: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(ids))
        return self.head(hidden)


def recurrent_lm(vocab: int = 128, width: int = 128) -> nn.Module:
    return RecurrentLM(vocab, width)
class ExpertParallelMoE(nn.Module):
    """A GShard-style mixture-of-experts layer with static shapes, written so that expert
    parallelism is a layout: tokens in ``groups`` (x is [G, S, D], a group per rank under data
    parallelism), a top-1 router, each token given a slot of its expert's ``capacity`` in its group
    (tokens past it dropped), the slots' tokens gathered per expert (``gsec,gsd->gecd``), the
    experts' stacked weights applied (``gecd,edh->gech``: the expert dim e of the weights and the
    tokens alike) and the outputs weighted back (``gsec,gecd->gsd``). With the groups split over a
    mesh axis before and after the experts and the experts split over it in between, the plan moves
    each rank's tokens to their experts' ranks and back: two all-to-alls (``[S0, R, R, R] ->
    [R, S0, R, R]``)."""

    def __init__(self, d_model: int = 16, d_hidden: int = 32, experts: int = 4, capacity: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d_model, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, d_model, d_hidden) * d_model ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, d_hidden, d_model) * d_hidden ** -0.5)
        # the ids an expert and a slot are compared with (buffers: a graph input, not a factory call)
        self.register_buffer("expert_ids", torch.arange(experts), persistent=False)
        self.register_buffer("slot_ids", torch.arange(capacity), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1)                        # [G, S, E]
        gate, expert = torch.max(probs, dim=-1)                              # top-1: [G, S]
        # one-hot masks as the probabilities' dtype: zeros with ones filled in where the ids match
        chosen = (probs * 0.0).masked_fill(torch.eq(expert.unsqueeze(-1), self.expert_ids), 1.0)   # [G, S, E]
        slot = torch.cumsum(chosen, dim=1) * chosen - 1.0                    # its place in its expert's queue
        place = slot.unsqueeze(-1) - self.slot_ids                           # [G, S, E, C]: 0 at its slot
        dispatch = (place * 0.0).masked_fill(torch.eq(slot.unsqueeze(-1), self.slot_ids), 1.0)   # past capacity: none
        tokens = torch.einsum("gsec,gsd->gecd", dispatch, x)                 # each expert's slots
        hidden = torch.relu(torch.einsum("gecd,edh->gech", tokens, self.w_in))
        out = torch.einsum("gech,ehd->gecd", hidden, self.w_out)
        combine = dispatch * gate.unsqueeze(-1).unsqueeze(-1)
        return torch.einsum("gsec,gecd->gsd", combine, out)


def expert_parallel_moe(d_model: int = 16, d_hidden: int = 32, experts: int = 4, capacity: int = 4) -> nn.Module:
    return ExpertParallelMoE(d_model, d_hidden, experts, capacity)
